"""The "triton" backend: :mod:`flashlib.kernels.triton`, compiled on a GPU, Triton's interpreter on a CPU.

The kernels are imported on first use (importing flashlib imports no triton). The caller's
``(block_q, block_k)`` become a :class:`~flashlib.kernels.triton.configs.Config`; None lets the
device's table choose.

Kernel versions (:mod:`flashlib.backends.variants`: one table per role, one ``pick``): the forwards
:data:`FORWARD` are version 1 (:mod:`~flashlib.kernels.triton.fa2_fwd_v1`, pointer loads, the default) and
version 4 (:mod:`~flashlib.kernels.triton.fa2_fwd_v4_tma`: tensor descriptors, TMA on sm_90); the backwards
:data:`BACKWARD` version 2 (:mod:`~flashlib.kernels.triton.fa2_bwd_v2`, the default) and version 5 (its
dK/dV kernel through tensor descriptors, :mod:`~flashlib.kernels.triton.fa2_bwd_v5_tma`); decode
:data:`DECODE` version 3. ``flashlib.attention(..., kernel="v4")`` (or ``kernel=("v4", "v5")``) names
one; ``FLASHLIB_TRITON_FWD`` / ``FLASHLIB_TRITON_BWD`` set the default (``v4``/``v5``, or ``tma`` for
either), which runs where its memory rules hold (:func:`~flashlib.kernels.triton.fa2_fwd_v4_tma.supported`)
and the default elsewhere. The TMA versions are opt-in until a GPU has measured them faster; they need
tensor descriptors (triton >= 3.4).

Triton versions: ``check`` raises RuntimeError where ``triton`` is missing or older than flashlib
supports (:mod:`flashlib.kernels.triton.versions`, naming the version and the fix), which
``backend="auto"`` takes as "use the next backend" (:func:`flashlib.backends.auto_choice`).

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import functools
import types

from ..validation import lengths_as_int32
from .variants import Family, Variant

DESCRIPTION = "flashlib.kernels.triton kernels (compiled on CUDA, Triton's interpreter on CPU)"

# The host path runs on every call (a small call's whole cost on a GPU): the kernel modules are imported
# once (_kernels), a caller's blocks become a Config once (_config), and the environment's defaults are
# read on each call (tests and the bench change them between calls), one lookup each.


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """The kernel modules (and torch), imported on first use: importing flashlib imports no triton."""
    import torch

    from ..kernels import triton as ft
    from ..kernels.triton import configs, decode_v3 as decode, fa2_bwd_v2, fa2_bwd_v5_tma, fa2_fwd_v1, fa2_fwd_v4_tma
    return types.SimpleNamespace(ft=ft, configs=configs, fa2_fwd_v1=fa2_fwd_v1, fa2_fwd_v4_tma=fa2_fwd_v4_tma,
                                 fa2_bwd_v2=fa2_bwd_v2, fa2_bwd_v5_tma=fa2_bwd_v5_tma, decode=decode, torch=torch)


def _tma_supported(*tensors, **variants) -> str | None:
    """The TMA forward (v4): the descriptors' memory rules, and no attention variant."""
    return _kernels().fa2_fwd_v4_tma.supported(*tensors, **variants)


def _tma_bwd_supported(*tensors, **variants) -> str | None:
    """The TMA dK/dV (v5): the descriptors' memory rules; it computes every variant (it shares
    kit.dkdv_step with version 2)."""
    return _kernels().fa2_fwd_v4_tma.supported(*tensors)


FORWARD = Family("triton forward", (
    Variant("v1", "fa2_fwd_v1.py: FlashAttention-2 forward, pointer loads (the default)"),
    Variant("v4", "fa2_fwd_v4_tma.py: the forward through tensor descriptors (TMA on sm_90)", _tma_supported),
), env="FLASHLIB_TRITON_FWD", aliases={"tma": "v4"})
BACKWARD = Family("triton backward", (
    Variant("v2", "fa2_bwd_v2.py: FlashAttention-2 backward, three kernels (the default)"),
    Variant("v5", "fa2_bwd_v5_tma.py: version 2 with its dK/dV kernel through tensor descriptors",
            _tma_bwd_supported),
), env="FLASHLIB_TRITON_BWD", aliases={"tma": "v5"})
DECODE = Family("triton decode", (
    Variant("v3", "decode_v3.py: Flash-Decoding, split-KV then combine"),))
KERNELS = {"forward": FORWARD, "backward": BACKWARD, "decode": DECODE}
VARIANTS = {"attention": frozenset({"window_size", "softcap", "alibi_slopes", "sinks", "dropout_p"}),
            "varlen": frozenset({"window_size", "softcap", "alibi_slopes", "sinks", "dropout_p"}),
            "decode": frozenset({"window_size", "softcap", "alibi_slopes", "sinks", "block_table"})}
KNOBS = {f.env: f.names for f in (FORWARD, BACKWARD)}    # read by info, bench


def forward_version(q, k, v, kernel=None) -> str:
    """The forward version that runs for these tensors (:meth:`FORWARD.pick <Family.pick>`): "v1",
    or "v4" where ``kernel`` or ``FLASHLIB_TRITON_FWD`` asks for it and
    :func:`flashlib.kernels.triton.fa2_fwd_v4_tma.supported` accepts them.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_fa2_fwd_v4_tma.py.
    """
    return FORWARD.pick(kernel, q, k, v).name


def backward_version(q, k, v, do, kernel=None) -> str:
    """The backward that runs: "v2" (fa2_bwd_v2), or "v5" (its dK/dV kernel through tensor descriptors,
    :mod:`flashlib.kernels.triton.fa2_bwd_v5_tma`) where ``kernel`` or ``FLASHLIB_TRITON_BWD`` asks for it
    and :func:`flashlib.kernels.triton.fa2_fwd_v4_tma.supported` accepts q, k, v and do.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_fa2_bwd_v5_tma.py.
    """
    return BACKWARD.pick(kernel, q, k, v, do).name


def _last_dim_contiguous(*xs):
    for x in xs:
        if x.stride(-1) != 1:                         # rare: copy those that need it
            return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)
    return xs


@functools.lru_cache(maxsize=64)
def _table_config(blocks):
    """A Config from the caller's (block_q, block_k), one of them None or both given (see _config)."""
    for name, b in zip(("block_q", "block_k"), blocks):
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"backend='triton' needs {name} to be a power of two >= 16 (tl.arange "
                             f"and tl.dot), got {b}")
    return _kernels().configs.Config(*blocks, num_warps=4, num_stages=1)


def _config(blocks):
    """A Config from the caller's (block_q, block_k), or None to let the device's table choose. A None
    block stays None: the table's first candidate fills it (configs.candidates)."""
    blocks = tuple(blocks)                       # hashable for the cache (a list works too)
    return None if blocks == (None, None) else _table_config(blocks)


class _OnDevice:
    """``with _OnDevice(q):`` makes q's CUDA device current for the block. Triton launches on the
    *current* device, whatever device the tensors are on, so tensors on cuda:1 while cuda:0 is current
    would be launched on the wrong GPU (flash-attn guards its kernels the same way). On a CPU, or where
    q's device is already current (the usual case: one comparison), nothing is changed. A class, not a
    wrapper: no frame between the backend's entry and the kernel's launcher.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_host.py.
    """
    __slots__ = ("guard",)

    def __init__(self, q):
        d = q.device
        self.guard = None
        if d.type == "cuda" and d.index is not None:
            torch = _kernels().torch
            if d.index != torch.cuda.current_device():
                self.guard = torch.cuda.device(d)

    def __enter__(self):
        if self.guard is not None:
            self.guard.__enter__()

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)


def forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None), kernel=None, **variants):
    """Backend.forward: :func:`flashlib.kernels.triton.fa2_fwd_v1.forward` with version 1's spec or
    version 4's (:data:`FORWARD`, ``kernel`` or the environment's default), and the attention
    variants (window, softcap, ALiBi, sinks, dropout: version 1 only).
    Explained in: notebooks/07_triton."""
    kernels = _kernels()
    q, k, v = _last_dim_contiguous(q, k, v)
    BACKWARD.check_env()                 # a bad backward default fails before the forward runs
    v4 = FORWARD.pick(kernel, q, k, v, **variants).name == "v4"
    spec = kernels.fa2_fwd_v4_tma.SPEC if v4 else kernels.fa2_fwd_v1.SPEC
    with _OnDevice(q):
        return kernels.fa2_fwd_v1.forward(q, k, v, causal=causal, scale=scale, allow_tf32=allow_tf32,
                                          config=_config(blocks), spec=spec, **variants)


def backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None), kernel=None,
             **variants):
    """Backend.backward: :func:`flashlib.kernels.triton.fa2_bwd_v2.backward`, with version 5's dK/dV
    kernel where :data:`BACKWARD` picks it (``kernel`` or the environment's default), and the
    attention variants (version 2 only; with sinks, ``dsinks`` as a fourth gradient).
    Explained in: notebooks/07_triton."""
    kernels = _kernels()
    q, k, v, o, do = _last_dim_contiguous(q, k, v, o, do)
    cfg = _config(blocks)                         # dK/dV: key block = block_k, query step = block_q
    tma = BACKWARD.pick(kernel, q, k, v, do, **variants).name == "v5"
    with _OnDevice(q):
        return kernels.fa2_bwd_v2.backward(
            q, k, v, o, lse, do, causal=causal, scale=scale, allow_tf32=allow_tf32, config_dkdv=cfg,
            config_dq=cfg, dkdv_spec=kernels.fa2_bwd_v5_tma.DKDV_SPEC if tma else kernels.fa2_bwd_v2.DKDV_SPEC,
            **variants)


def forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, allow_tf32=False, **variants):
    """Backend.forward_varlen: :func:`flashlib.kernels.triton.fa2_fwd_v1.forward_varlen`, the forward's
    kernel with its ragged switch (one flat grid over sequences and query blocks), with the variants.
    Explained in: notebooks/10_serving."""
    kernels = _kernels()
    q, k, v = _last_dim_contiguous(q, k, v)
    with _OnDevice(q):
        return kernels.fa2_fwd_v1.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale,
                                                 allow_tf32=allow_tf32, **variants)


def backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, *, causal, scale, allow_tf32=False,
                    **variants):
    """Backend.backward_varlen: :func:`flashlib.kernels.triton.fa2_bwd_v2.backward_varlen` (with sinks,
    ``dsinks`` as a fourth gradient).
    Explained in: notebooks/10_serving."""
    kernels = _kernels()
    q, k, v, o, do = _last_dim_contiguous(q, k, v, o, do)
    with _OnDevice(q):
        return kernels.fa2_bwd_v2.backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal=causal,
                                                  scale=scale, allow_tf32=allow_tf32, **variants)


MIN_DECODE_BLOCK_N = 16      # the smallest key block of a decode config (tl.dot needs >= 16)


def decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale, kernel=None, block_table=None, **variants):
    """Backend.decode: :func:`flashlib.kernels.triton.decode_v3.decode` (split-KV, then combine);
    ``cache_seqlens`` None reaches the kernel as None (no lengths tensor is made). int64 lengths are
    clamped into ``[0, Nmax]`` in 64 bits on their device (no read-back) before they become the
    kernel's int32: 2**32 + 3 means Nmax, not 3. The kernel's splits are whole key blocks
    (``MIN_DECODE_BLOCK_N`` keys or more), so at most ``ceil(Nmax / MIN_DECODE_BLOCK_N)`` of them can
    hold a key: ``num_splits`` is clamped to that (the splits dropped were empty: the same answer).
    With ``block_table`` the caches are paged ``(num_pages, page_size, Hkv, d)`` and Nmax is a
    sequence's capacity, ``max_pages · page_size`` (the kernel gathers rows through the table).
    Explained in: notebooks/07_triton."""
    kernels = _kernels()
    if kernel is not None:
        DECODE.get(kernel)                # one version: nothing to choose, but a wrong name fails
    q, k_cache, v_cache = _last_dim_contiguous(q, k_cache, v_cache)
    paged = {} if block_table is None else {"block_table": block_table.contiguous()}
    nmax = k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    if cache_seqlens is not None:
        cache_seqlens = lengths_as_int32(cache_seqlens, nmax)
    num_splits = max(1, min(num_splits, -(-nmax // MIN_DECODE_BLOCK_N)))
    with _OnDevice(q):
        return kernels.decode.decode(q, k_cache, v_cache, cache_seqlens, num_splits=num_splits, scale=scale,
                                     **paged, **variants)


def check(q, op):
    """Backend.check: triton importable and supported (>= 3.2: RuntimeError naming the version and the
    fix otherwise), in the mode q's device needs (meta tensors: any mode, nothing runs); no float64;
    bf16 needs sm_80+.
    Explained in: notebooks/07_triton."""
    # Plain imports, not _kernels(): check runs while torch.compile traces flashlib.attention, and dynamo
    # traces an import but breaks the graph at a functools.cache wrapper.
    import torch
    try:
        from ..kernels import triton as ft
    except ImportError as exc:
        raise RuntimeError(f"backend='triton' cannot run here: {exc}") from None
    if not q.is_meta:                              # meta: shapes only (flashlib._ops), no kernel
        ft.check_tensors(q)
    if q.dtype == torch.float64:
        raise TypeError("backend='triton' supports float16, bfloat16 and float32, got torch.float64; "
                        "use backend='reference' for float64")
    from ..hardware import device_facts            # a GPU's (asked once per index), or a rehearsed one's
    facts = device_facts(q.device)
    if facts is not None:
        from ..kernels.triton.configs import check_dtype_arch
        check_dtype_arch(str(q.dtype).removeprefix("torch."), facts.arch)
