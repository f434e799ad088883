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
* :mod:`flashlib.parallel` — beyond one GPU: ring attention and its process launcher (chapter 10);
* :mod:`flashlib.auto` (route torch SDPA to flashlib), :mod:`flashlib.models` (chapter 9),
  :mod:`flashlib.hardware` (GPU facts), :mod:`flashlib.testing` (the float64 oracle and the checkers;
  ``testing.ring``, the ring attention harness).

The ladder's modules are also reachable under their short names (``flashlib.fa2``,
``import flashlib.naive``), as the chapters first introduce them.
"""
import sys as _sys

from . import hardware, testing
from .ladder import decoding, fa1, fa2, iomodel, memeff, naive, softmax
from .display import show
from .ladder.iomodel import IOCounter
from .api import attention, attention_qkvpacked, decode

for _m in (decoding, fa1, fa2, iomodel, memeff, naive, softmax):    # import flashlib.fa2 works too
    _sys.modules.setdefault(f"{__name__}.{_m.__name__.rsplit('.', 1)[1]}", _m)

__version__ = "0.1.0"
__all__ = ["naive", "softmax", "memeff", "fa1", "fa2", "decoding", "iomodel", "testing", "hardware",
           "IOCounter", "show", "attention", "attention_qkvpacked", "decode"]
