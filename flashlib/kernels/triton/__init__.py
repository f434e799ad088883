"""flashlib's Triton kernels: FlashAttention-2 forward and backward, Flash-Decoding.

One file per kernel, each opening with what changed from the version before it. The kernels are
numbered versions (one table per role in :mod:`flashlib.backends.triton`; ``flashlib.attention(...,
backend="triton", kernel="v4")`` or ``kernel=("v4", "v5")`` names them, ``FLASHLIB_TRITON_FWD`` and
``FLASHLIB_TRITON_BWD`` set the defaults):

* version 1, :mod:`flashlib.kernels.triton.fa2_fwd_v1` — FA2 forward (one program per query block and
  batch·head), the default forward;
* version 2, :mod:`flashlib.kernels.triton.fa2_bwd_v2` — FA2 backward (D preprocess, dK/dV per key block,
  dQ per query block), the default backward;
* version 3, :mod:`flashlib.kernels.triton.decode_v3` — Flash-Decoding (split-KV partial attention, then an
  LSE combine);
* version 4, :mod:`flashlib.kernels.triton.fa2_fwd_v4_tma` — version 1 through tensor descriptors (TMA on
  sm_90), launched by version 1's ``fa2_fwd_v1.forward`` with its own spec; opt-in (``kernel="v4"``,
  or ``FLASHLIB_TRITON_FWD=v4``);
* version 5, :mod:`flashlib.kernels.triton.fa2_bwd_v5_tma` — version 2 with its dK/dV kernel through tensor
  descriptors; opt-in (``kernel=(None, "v5")``, or ``FLASHLIB_TRITON_BWD=v5``);

and what they share:

* :mod:`flashlib.kernels.triton.kit` — the @triton.jit helpers the kernels share (grid decode, key and
  query ranges, tile loads, the online-softmax step and its inner loop, the masks) and named constants;
* :mod:`flashlib.kernels.triton.spec` — :class:`~flashlib.kernels.triton.spec.KernelSpec`, each kernel
  described once beside it from its own signature (arguments, grid, config table, shared-memory
  estimate) and launched one way (``SPEC.launch(config, **args)``: the candidates, the fall-back on
  OutOfResources, the descriptors' scratch); the compile report compiles every kernel from it;
* :mod:`flashlib.kernels.triton.configs` — how a kernel's config is chosen per architecture (the
  candidates beside each spec, pruned by the shared-memory limit; the hazard rule);
* :mod:`flashlib.kernels.triton.tables` — every kernel's candidates laid out by architecture (a view).

Grids. Every kernel launches a one-dimensional grid (:func:`flat_grid`): CUDA allows 2^31 - 1
programs on axis 0 but only 65,535 on axes 1 and 2, so a (blocks, batch·heads) grid failed at
B·H > 65,535 (B = 1024, H = 128: "invalid argument"). A kernel decodes its block and its batch·head
from ``tl.program_id(0)`` (``kit.unflatten``); the blocks of one head are consecutive programs, so they run side by side
and share that head's K/V in L2.

Triton versions. :mod:`flashlib.kernels.triton.versions` names the supported range (triton >= 3.2, the
oldest a Colab GPU runtime ships; pyproject's ``triton`` extra says the same) and the facts that hold
for some releases only; importing this package with an older Triton raises ImportError naming the
version and the fix, and ``backend="auto"`` then chooses another backend.

Interpreter or compiler. Triton fixes its mode when ``triton`` is first imported (it reads
``TRITON_INTERPRET`` once, in ``triton.runtime.interpreter``'s import-time setup of ``tl``): with ``TRITON_INTERPRET=1`` every kernel runs on CPU tensors in Triton's NumPy interpreter,
without it every kernel is compiled for the GPU. Importing this package on a machine with no CUDA
device sets ``TRITON_INTERPRET=1`` *before* the first ``import triton`` (unless the variable is already
set, which we respect), so ``flashlib.attention(..., backend="triton")`` runs on CPU tensors with no
set-up; ``import flashlib`` installs an import hook that applies the same rule to triton's first
import by anyone else (``torch.compile`` imports it; :mod:`flashlib`). If ``triton`` was imported in
compile mode before flashlib, CPU tensors are refused by :func:`check_tensors`, saying what to do.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import os
import sys

__all__ = ["INTERPRET", "interpreting", "check_tensors", "flat_grid", "triton", "tl"]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is required for the kernels anyway
        return False
    return torch.cuda.is_available()


if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"    # before the first `import triton`: the mode is fixed then

from ...hardware import flat_programs  # noqa: E402

try:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError("flashlib.kernels.triton needs the `triton` package (Linux: pip install triton); "
                      "use backend='reference' without it") from exc

from . import versions# noqa: E402

versions.check_supported()   # ImportError naming the version and the fix for a Triton older than 3.2


def interpreting() -> bool:
    """True when this process runs Triton kernels in the interpreter (decided at the first import).

    Triton decorates its own helpers (``tl.max``, ``tl.sum``...) when it is imported, as interpreted
    or as compiled functions; their type tells which mode this process is in for good.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    return type(tl.standard.max).__name__ == "InterpretedFunction"


INTERPRET: bool = interpreting()


def _round_bfloat16_as_a_gpu_does() -> None:
    """In the interpreter, round float32 -> bfloat16 to nearest even, as compiled code does.

    A compiled ``x.to(tl.bfloat16)`` rounds to nearest even (``cvt.rn.bf16.f32``; Triton's default
    downcast rounding, triton PR 2795). Triton's interpreter (3.x, ``_convert_float``) instead drops the
    low 16 bits unless asked for RTNE: round toward zero. Every bfloat16 result of an interpreted kernel
    then lands up to one ulp below the GPU's, a bias that FlashAttention's error rule sees (an output of
    2.124 stored as 2.109 instead of 2.125). Only that one conversion is replaced, by torch's (which
    rounds to nearest even); every other conversion, and an explicit ``fp_downcast_rounding="rtz"``,
    stays Triton's own.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_kit.py.
    """
    import numpy as np
    import torch
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "rounds_bfloat16_to_nearest", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if (input_dtype == tl.float32 and output_dtype == tl.bfloat16
                and rounding_mode in (None, ir.ROUNDING_MODE.RTNE)):
            x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)
    convert.rounds_bfloat16_to_nearest = True
    convert.triton_original = original
    interpreter._convert_float = convert


if INTERPRET:
    _round_bfloat16_as_a_gpu_does()


def check_tensors(*tensors) -> None:
    """Refuse tensors this process cannot run Triton kernels on, saying what to do instead.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/test_validation.py.
    """
    devices = {t.device.type for t in tensors}
    if INTERPRET and devices != {"cpu"}:
        raise RuntimeError(
            "backend='triton': Triton runs in interpreter mode in this process (TRITON_INTERPRET=1 "
            f"was set when triton was first imported), which takes CPU tensors; got {sorted(devices)}. "
            "Move the tensors to the CPU, or start a new process without TRITON_INTERPRET to compile.")
    if not INTERPRET and devices != {"cuda"}:
        raise RuntimeError(
            "backend='triton': triton was imported in compile mode in this process (before flashlib "
            "could set TRITON_INTERPRET=1), so its kernels need CUDA tensors; got "
            f"{sorted(devices)}. Use CUDA tensors, use backend='reference', or start a new process "
            "that imports flashlib before anything imports triton (torch.compile and torch._dynamo "
            "do), or sets TRITON_INTERPRET=1, to interpret on the CPU.")


def flat_grid(*counts: int) -> tuple[int]:
    """The one-axis grid of ``prod(counts)`` programs that every flashlib
    kernel launches.

    ``counts`` from the slowest-varying to the fastest (e.g. ``B·H``, query
    blocks per head): the kernel decodes them back from ``tl.program_id(0)``
    in the same order. Raises ValueError beyond CUDA's 2^31 - 1 programs
    (:func:`flashlib.hardware.flat_programs`; about 10^11 query rows at 64
    rows per program: memory runs out first).
    Explained in: notebooks/07_triton.

    Tested in: tests/kernels/triton/test_triton_kit.py.
    """
    return (flat_programs(*counts),)
