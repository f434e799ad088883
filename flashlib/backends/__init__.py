"""The attention backends: a registry of named ways to compute attention, one module per backend.

* :mod:`flashlib.backends.reference` — the ladder's NumPy FlashAttention-2 and Flash-Decoding on a
  CPU copy (slow, any device, float64 too);
* :mod:`flashlib.backends.triton` — :mod:`flashlib.kernels.triton` (compiled on a GPU, Triton's
  interpreter on a CPU);
* :mod:`flashlib.backends.cuda` — :mod:`flashlib.kernels.cuda`'s CUDA C++ (NVRTC on a GPU, flashlib's
  emulator on a CPU).

Each module has the four functions of :class:`Backend`: ``forward``, ``backward``, ``decode`` and
``check``. :func:`flashlib.attention` and :func:`flashlib.decode` validate their arguments, then
:func:`resolve` turns the ``backend`` argument ("auto" or a name) into a :class:`Backend`. Adding a
backend: write the four functions, ``register_backend(Backend("mine", ...))``, and, to make it the
default for a device type, ``AUTO["cuda"] = "mine"``. Importing this package imports neither torch
nor triton; the backend modules import them when first called.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable

from . import cuda, reference, triton

__all__ = ["Backend", "BACKENDS", "AUTO", "register_backend", "registered", "resolve", "auto_choice"]


@dataclass(frozen=True)
class Backend:
    """One way of computing attention. Tensors in, tensors out, layout ``(B, H, N, d)``.

    ``forward(q, k, v, *, causal, scale, allow_tf32, blocks) -> (o, lse)``;
    ``backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32, blocks) -> (dq, dk, dv)``
    (``blocks`` = the caller's ``(block_q, block_k)``, None for "backend's choice"; dk, dv shaped
    like k, v: GQA groups summed); ``decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale)
    -> (o, lse)`` (``cache_seqlens`` None: every sequence uses the whole cache); ``check(q, op)``
    raises (ValueError/RuntimeError with the reason) when this backend cannot run on ``q``'s device
    and dtype in this process, ``op`` being "attention" or "decode". ``kernels``: its kernel versions,
    ``{"forward" | "backward" | "decode": Family}`` (:mod:`flashlib.backends.variants`); a backend
    with versions takes ``kernel=`` (a version name, or None: its default) in the three functions, and
    is passed it only when the caller names one. ``variants``: the attention variants it computes,
    ``{"attention" | "decode": frozenset of names}`` out of ``window_size``, ``softcap``,
    ``alibi_slopes``, ``sinks``, ``dropout_p`` (:func:`flashlib.validation.check_variants`); each is
    passed as a keyword only when the caller uses it (``dropout_p`` with ``dropout_seed``), and a
    backend that lacks one is refused by name (``backend="auto"`` passes it over). With ``sinks`` the
    backward returns ``dsinks`` ``(H,)`` float32 as a fourth gradient.
    Ragged batches (chapter 10): ``forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal,
    scale, allow_tf32, **variants) -> (o, lse)`` with q ``(total_q, H, d)``, k, v ``(total_k, Hkv,
    d)``, lse ``(H, total_q)``, and ``backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k,
    *, causal, scale, allow_tf32, **variants) -> (dq, dk, dv[, dsinks])``; None: the backend has
    none (``variants["varlen"]`` lists the variants it computes there). Paged caches: ``decode`` is
    passed ``block_table`` (a "variant" of decode) with caches ``(num_pages, page_size, Hkv, d)``.
    Inputs reach a backend validated (:mod:`flashlib.validation`): same dtype and device,
    ``H % Hkv == 0``, head dim <= 256. ``lse`` is float32 (float64 for float64 inputs).

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/backends/test_backends.py.
    """
    name: str
    forward: Callable
    backward: Callable
    decode: Callable
    check: Callable
    description: str = field(default="", compare=False)
    kernels: dict = field(default_factory=dict, compare=False)
    variants: dict = field(default_factory=dict, compare=False)
    forward_varlen: Callable | None = field(default=None, compare=False)
    backward_varlen: Callable | None = field(default=None, compare=False)

    def lacks(self, op: str, used) -> list:
        """The variants of ``used`` (names) this backend cannot compute for ``op`` ("attention",
        "decode" or "varlen"; for "varlen", also ragged batches themselves)."""
        have = self.variants.get(op, frozenset())
        missing = [name for name in used if name not in have and name != "dropout_seed"]
        if op == "varlen" and (self.forward_varlen is None or self.backward_varlen is None):
            missing.insert(0, "ragged batches (attention_varlen)")
        return missing


BACKENDS: dict[str, Backend] = {}
AUTO: dict[str, str] = {"cuda": "triton", "cpu": "reference"}   # device type -> backend for "auto"


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` under ``backend.name`` (replacing one of that name).

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/backends/test_backends.py.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a flashlib.backends.Backend, got {type(backend).__name__}")
    BACKENDS[backend.name] = backend
    return backend


@contextlib.contextmanager
def registered(backend: Backend):
    """Register ``backend`` for the duration of a ``with`` block only; on leaving it (even by an
    exception) :data:`BACKENDS` is as before, with any backend of that name restored.

    ``with registered(Backend("spy", ...)): flashlib.attention(q, k, v, backend="spy")``.
    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/backends/test_backends.py.
    """
    before = BACKENDS.get(getattr(backend, "name", None))
    register_backend(backend)
    try:
        yield backend
    finally:
        if before is None:
            BACKENDS.pop(backend.name, None)
        else:
            BACKENDS[backend.name] = before


def resolve(backend, q, op: str = "attention", used=()) -> Backend:
    """The :class:`Backend` that ``backend`` ("auto", or a name in :data:`BACKENDS`) means for the
    tensor ``q``, after its ``check(q, op)`` (``op``: "attention", "decode" or "varlen") found that it can run,
    and that computes the variants named in ``used`` (``window_size``, ``softcap``, ...: a ValueError
    naming them otherwise).

    "auto" picks :data:`AUTO` of q's device type ("reference" for a device type it does not name); if
    that backend cannot run in this process (its check raises RuntimeError: triton missing, or older
    than flashlib supports), "auto" takes "reference" instead, with a RuntimeWarning saying why
    (:func:`auto_choice`). A refusal of the input itself (ValueError/TypeError: bf16 before sm_80)
    stands.
    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/backends/test_backends.py.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend == "auto":
        name, why = auto_choice(q, op, used)
        if why is not None:
            warnings.warn(why, RuntimeWarning, stacklevel=3)
        return BACKENDS[name]
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *sorted(BACKENDS)]}, got {backend!r}")
    chosen = BACKENDS[backend]
    lacking = chosen.lacks(op, used)
    if lacking:
        able = [n for n, b in sorted(BACKENDS.items()) if not b.lacks(op, used)]
        raise ValueError(f"backend={backend!r} does not compute {', '.join(lacking)} ({op}); "
                         f"backends that do: {able}")
    chosen.check(q, op)
    return chosen


def auto_choice(q, op: str = "attention", used=()) -> tuple[str, str | None]:
    """``(name, why)``: the backend ``backend="auto"`` runs for ``q`` (its check passed), and None, or
    why :data:`AUTO`'s choice was passed over ("backend='auto' uses 'reference' on cuda tensors:
    backend='triton' cannot run here: ... triton 3.1.0 ..."). Raises what the chosen backend's check
    raises for the input itself.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    name = AUTO.get(q.device.type, "reference")
    lacking = BACKENDS[name].lacks(op, used)
    if lacking:                                     # never a backend that would refuse the call
        BACKENDS["reference"].check(q, op)
        return "reference", (f"backend='auto' uses 'reference' (NumPy on a CPU copy: slow) on "
                             f"{q.device.type} tensors, because backend={name!r} does not compute "
                             f"{', '.join(lacking)}")
    try:
        BACKENDS[name].check(q, op)
        return name, None
    except RuntimeError as exc:                     # cannot run in this process: the next backend
        if name == "reference":
            raise
        BACKENDS["reference"].check(q, op)
        return "reference", (f"backend='auto' uses 'reference' (NumPy on a CPU copy: slow) on "
                             f"{q.device.type} tensors, because {exc}")


for _name, _module in (("reference", reference), ("triton", triton), ("cuda", cuda)):
    register_backend(Backend(_name, _module.forward, _module.backward, _module.decode, _module.check,
                             _module.DESCRIPTION, _module.KERNELS, _module.VARIANTS,
                             getattr(_module, "forward_varlen", None), getattr(_module, "backward_varlen", None)))
