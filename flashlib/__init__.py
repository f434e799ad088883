"""flashlib — the tested library behind flashbook, a FlashAttention tutorial from first principles.

The map (each folder one layer; ``python -m flashlib`` is the command line):

* :mod:`flashlib.api` — the public torch functions :func:`attention`, :func:`attention_qkvpacked`,
  :func:`decode`; :mod:`flashlib.validation` — their one validator; :mod:`flashlib._ops` — their
  autograd (torch custom ops); :mod:`flashlib.backends` — the registry and one module per backend
  ("reference", "triton", "cuda");
* :mod:`flashlib.ladder` — the NumPy algorithms, one module per chapter: ``naive`` (1), ``softmax`` and
  ``memeff`` (2), ``fa1`` (3), ``fa2`` (4, 5), ``decoding`` (6), and ``iomodel``, the counted HBM/SRAM
  memory model they all report to;
* :mod:`flashlib.kernels` — real kernels: ``kernels.triton`` (chapter 7) and ``kernels.cuda``
  (CUDA C++ sources, their CPU emulator and launcher; chapter 8);
* :mod:`flashlib.tools` — the compile report, benchmarks, the self-check, timing and the tool chain;
* :mod:`flashlib.parallel` — beyond one GPU: ring attention and its process launcher (chapter 12);
* :mod:`flashlib.auto` (route torch SDPA to flashlib), :mod:`flashlib.models` (chapter 11),
  :mod:`flashlib.hardware` (GPU facts), :mod:`flashlib.testing` (the float64 oracle and the checkers;
  ``testing.ring``, the ring attention harness).

The ladder's modules are also reachable under their short names (``flashlib.fa2``,
``import flashlib.naive``), as the chapters first introduce them.

Triton's mode (interpreter or compiler) is fixed by the first ``import triton`` in a process, and
``torch.compile`` imports triton (``torch._dynamo`` does, when imported). So that this first import,
whoever makes it, already runs the interpreter where no CUDA device is present,
:class:`_TritonModeFirst` sets ``TRITON_INTERPRET=1`` just before it, as
:mod:`flashlib.kernels.triton` does before its own import (importing flashlib still imports neither
torch nor triton). Only a triton imported before flashlib is beyond reach: the Triton backend then
refuses CPU tensors with a message saying what to do.
"""
import os as _os
import sys as _sys


def _interpret_without_a_gpu() -> None:
    """Set ``TRITON_INTERPRET=1`` if triton is not imported yet, the variable is unset (a user's
    choice is respected) and torch, already imported, sees no CUDA device: the rule of
    :mod:`flashlib.kernels.triton`. Imports nothing (without torch it decides nothing)."""
    torch = _sys.modules.get("torch")
    if torch is None or "triton" in _sys.modules or "TRITON_INTERPRET" in _os.environ:
        return
    try:
        if torch.cuda.is_available():
            return
    except Exception:         # noqa: BLE001 - torch half-imported: decide nothing here
        return
    _os.environ["TRITON_INTERPRET"] = "1"


class _TritonModeFirst:
    """An import hook (first on :data:`sys.meta_path`) that applies :func:`_interpret_without_a_gpu`
    when ``triton`` is looked for (``import triton`` by torch.compile or anyone, or
    ``importlib.util.find_spec``), then finds nothing itself: Python's own finders import triton, in
    the mode chosen. A look-up costs one comparison; the finder stays in the list (removing one while
    Python walks the list would skip the next)."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton":
            _interpret_without_a_gpu()
        return None


if "triton" not in _sys.modules and not any(type(f).__name__ == "_TritonModeFirst"
                                            for f in _sys.meta_path):    # once, even if reloaded
    _sys.meta_path.insert(0, _TritonModeFirst())

from . import hardware, testing
from .ladder import decoding, fa1, fa2, iomodel, memeff, naive, softmax
from .display import show
from .ladder.iomodel import IOCounter
from .api import append_kv, attention, attention_qkvpacked, attention_varlen, decode, default_num_splits, dropout_mask
from .states import merge_states, merge_states_many

for _m in (decoding, fa1, fa2, iomodel, memeff, naive, softmax):    # import flashlib.fa2 works too
    _sys.modules.setdefault(f"{__name__}.{_m.__name__.rsplit('.', 1)[1]}", _m)

__version__ = "0.1.0"
__all__ = ["naive", "softmax", "memeff", "fa1", "fa2", "decoding", "iomodel", "testing", "hardware",
           "IOCounter", "show", "attention", "attention_qkvpacked", "attention_varlen", "decode",
           "append_kv", "merge_states", "merge_states_many", "default_num_splits", "dropout_mask"]
