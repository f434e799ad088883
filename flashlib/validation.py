"""The one validator of flashlib's torch-facing arguments.

:func:`flashlib.attention` and :func:`flashlib.decode` (:mod:`flashlib.api`), the CUDA kernels' entry
points (:mod:`flashlib.kernels.cuda`) and :func:`~flashlib.parallel.ring.ring_attention` all check
their arguments here; the ladder's NumPy checks (:mod:`flashlib.ladder._checks`) share :func:`check_scale`
and :func:`check_block`. Bad input is refused with a TypeError or ValueError that names the
argument, what was expected and what came.

This module imports nothing from flashlib, so any module may call it without closing an import
cycle (``api`` → ``backends`` → ``kernels.cuda`` → ``api`` would be one), and it imports torch only
inside the checks that need it.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import math
import numbers

__all__ = ["MAX_HEAD_DIM", "check_tensors", "check_scale", "check_flag", "check_block",
           "check_num_splits", "check_cache_seqlens", "check_window", "check_variants",
           "check_dropout_seed", "draw_dropout_seed", "VARIANT_NAMES"]
# The serving checks below (check_varlen_tensors, check_cu_seqlens, check_max_seqlen, check_paged_cache,
# check_block_table, check_new_tokens, check_capacity) are flashlib.api's helpers, tested through it.

MAX_HEAD_DIM = 256          # the largest head dim every backend supports


def check_tensors(q, k, v, *, k_name: str = "k", v_name: str = "v") -> None:
    """Check ``q (B, H, Nq, d)`` and ``k, v (B, Hkv, Nk, d)``: torch tensors of one float dtype on
    one device, ``H % Hkv == 0`` (GQA), ``Nq, Nk >= 1`` and ``1 <= d <= 256``.

    ``k_name``, ``v_name``: how the messages call k and v (``"k_cache"`` for decode).
    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/test_validation.py.
    """
    import torch
    for name, x in (("q", q), (k_name, k), (v_name, v)):
        if not isinstance(x, torch.Tensor):
            hint = (" (for NumPy arrays use the ladder, e.g. flashlib.ladder.fa2.forward)"
                    if type(x).__module__ == "numpy" else "")
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}{hint}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, N, d), 4 dims, got shape {tuple(x.shape)}")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    for name, x in ((k_name, k), (v_name, v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
    B, H, NQ, D = q.shape                                            # (B, H, Nq, d)
    if k.shape[0] != B:
        raise ValueError(f"{k_name} must have the batch size of q ({B}), got {k_name} {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"{v_name} must have the shape of {k_name} {tuple(k.shape)}, got "
                         f"{tuple(v.shape)}")
    if k.shape[-1] != D:
        raise ValueError(f"{k_name} must have the head dim of q ({D}), got {k_name} {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv < 1 or H % hkv:
        raise ValueError(f"the number of query heads H={H} must be a multiple of kv heads Hkv={hkv} "
                         f"(the heads of {k_name}); GQA/MQA: query head h reads kv head h // (H // Hkv)")
    if NQ < 1:
        raise ValueError(f"q must hold at least one query (Nq >= 1), got q {tuple(q.shape)}")
    if k.shape[2] < 1:
        raise ValueError(f"{k_name} and {v_name} must hold at least one key (Nk >= 1), got {k_name} "
                         f"{tuple(k.shape)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q's head dim must be between 1 and {MAX_HEAD_DIM}, got {D}")


def check_scale(scale, d: int) -> float:
    """The softmax scale: ``d ** -0.5`` when None, else a finite real number.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/test_validation.py.
    """
    if scale is None:
        return float(d) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_flag(value, name: str) -> bool:
    """``value`` as a bool if it is one (``True``/``False`` or NumPy's ``np.bool_``), else a TypeError
    naming ``name``: a merely truthy value (``"False"``, ``1``, ``None``) is refused, never taken
    literally. The torch API and the NumPy ladder both check their flags here.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/test_validation.py.
    """
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ == "bool":    # np.bool_ (numpy 1 or 2)
        return bool(value)
    kind = f"numpy.{type(value).__name__}" if type(value).__module__ == "numpy" else type(value).__name__
    raise TypeError(f"{name} must be a bool, got {kind} {value!r}")


def check_block(value, name: str, default: int | None = None) -> int:
    """A block size: a positive int (``default`` when None).

    Explained in: notebooks/03_flashattention1.
    Tested in: tests/test_validation.py.
    """
    if value is None:
        if default is None:
            raise ValueError(f"{name} is required")
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def check_int(value, name: str, low: int, high: int | None = None, why: str = "") -> int:
    """``value`` as an int in ``[low, high]`` (a Python or NumPy integer, not a bool), else a TypeError
    or ValueError naming ``name`` (``why``: a reason appended to the bounds)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{name} must be an int {bounds}{why}, got {value}")
    return int(value)


def check_count(value, name: str) -> int:
    """A count that may be zero (keys, operations; used by the ladder): an int >= 0, bool refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value}")
    return int(value)


def lengths_as_int32(cache_seqlens, nmax: int):
    """Decode's lengths as the kernels' contiguous int32 tensor, on their device. int64 lengths are
    clamped into ``[0, nmax]`` in 64 bits first (no read-back), so 2**32 + 3 means Nmax, never 3; int32
    ones pass as they are (the kernels clamp them)."""
    import torch
    if cache_seqlens.dtype != torch.int32:
        cache_seqlens = cache_seqlens.clamp(0, nmax).to(torch.int32)
    return cache_seqlens.contiguous()


def check_num_splits(num_splits) -> int:
    """Flash-Decoding's number of K/V splits: an int >= 1.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/test_validation.py.
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int >= 1, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits}")
    return int(num_splits)


def check_cache_seqlens(cache_seqlens, q, nmax: int):
    """Decode's valid cache lengths: an int32/int64 tensor ``(B,)`` on q's device with values in
    ``[0, nmax]``; returned as given.

    The values are read only when they already live on the CPU. Reading a GPU tensor's values back
    would make the host wait for the GPU (a synchronisation worth about 100 µs per decode step, and one
    that CUDA-graph capture forbids), so on a GPU only the type, shape and device are checked, and the
    decode kernels clamp each length into ``[0, nmax]`` themselves: a bad length can never read outside
    the cache. The same holds while ``torch.compile`` traces a call (a value read there would split the
    compiled graph), whatever the device.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/test_validation.py.
    """
    import torch
    B = q.shape[0]
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor of int32/int64 or None, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_seqlens must have dtype int32 or int64, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (B,):
        raise ValueError(f"cache_seqlens must have shape ({B},) (one length per sequence), got "
                         f"{tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on the device of q ({q.device}), got "
                         f"{cache_seqlens.device}")
    if cache_seqlens.device.type != "cpu" or torch.compiler.is_compiling():
        return cache_seqlens                  # no read-back (see above): the kernels clamp instead
    if cache_seqlens.numel() == 0:
        return cache_seqlens                  # an empty batch (B = 0): no length to check
    lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
    if lo < 0 or hi > nmax:
        raise ValueError(f"cache_seqlens must lie in [0, {nmax}] (Nmax of k_cache), got values in "
                         f"[{lo}, {hi}]")
    return cache_seqlens


VARIANT_NAMES = ("window_size", "softcap", "alibi_slopes", "sinks", "dropout_p")
MAX_DROPOUT_SEED = 2 ** 63 - 1      # a seed is any non-negative int64
MAX_DROPOUT_OFFSET = 2 ** 40        # room for the counters: offset + B·H·Nq·Nk < 2**63


def check_window(window_size) -> tuple[int, int]:
    """flash-attn's sliding window ``(left, right)``: two ints >= 0, or -1 for "unbounded" on that
    side. Query i sees key j iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_validation.py.
    """
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 for unbounded, got "
                        f"{window_size!r}")
    left, right = (check_int(w, "window_size entries", -1, why=" (-1: unbounded)") for w in window_size)
    return left, right


def _per_head(x, name: str, q, shapes: tuple) -> None:
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
    # float32, as flash-attn's; float64 inputs (the reference backend) may take float64 ones
    if x.dtype != torch.float32 and not (x.dtype == q.dtype == torch.float64):
        raise TypeError(f"{name} must be float32 (float64 with float64 inputs), got {x.dtype}")
    if tuple(x.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {want} (one per query head), got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")


def check_variants(q, *, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                   dropout_p=0.0, dropout_seed=None, op: str = "attention", batch_heads=None) -> dict:
    """The attention variants real models use (flash-attn's definitions; sinks FlashInfer's and
    gpt-oss's), checked: a dict holding only those not at their default, in the form the backends
    take (:class:`flashlib.backends.Backend`): ``window_size`` a pair of ints, ``softcap`` a float
    > 0, ``alibi_slopes`` float32 ``(B, H)`` contiguous (``(H,)`` expanded), ``sinks`` the caller's
    float32 ``(H,)`` tensor (autograd follows it; float64 inputs may give float64 slopes and sinks), ``dropout_p`` in (0, 1) with ``dropout_seed`` a
    pair ``(seed, offset)`` of ints (drawn by :func:`draw_dropout_seed` when None). ``op``
    "decode" refuses dropout (decode is inference). ``batch_heads``: ``(B, H)`` where q's first two
    dims are not (ragged batches: ``(len(cu_seqlens_q) - 1, q.shape[1])``). TypeError/ValueError
    naming the argument.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_validation.py.
    """
    B, H = batch_heads if batch_heads is not None else (q.shape[0], q.shape[1])
    out = {}
    window = check_window(window_size)
    if window != (-1, -1):
        out["window_size"] = window
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0.0: off), got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0.0: off), got {softcap}")
    if softcap > 0:
        out["softcap"] = float(softcap)
    if alibi_slopes is not None:
        _per_head(alibi_slopes, "alibi_slopes", q, ((H,), (B, H)))
        out["alibi_slopes"] = alibi_slopes.detach().expand(B, H).contiguous()   # slopes get no gradient
    if sinks is not None:
        _per_head(sinks, "sinks", q, ((H,),))
        out["sinks"] = sinks
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {type(dropout_p).__name__}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if dropout_p > 0:
        if op == "decode":
            raise ValueError(f"decode is inference: dropout_p must be 0.0, got {dropout_p}")
        out["dropout_p"] = float(dropout_p)
        out["dropout_seed"] = check_dropout_seed(dropout_seed)
    elif dropout_seed is not None:
        check_dropout_seed(dropout_seed)
    return out


def check_dropout_seed(dropout_seed) -> tuple[int, int]:
    """Dropout's Philox key and counter offset: a pair ``(seed, offset)`` of ints,
    ``0 <= seed < 2**63`` and ``0 <= offset < 2**40``; None draws one (:func:`draw_dropout_seed`).

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_validation.py.
    """
    if dropout_seed is None:
        return draw_dropout_seed()
    if not isinstance(dropout_seed, (tuple, list)) or len(dropout_seed) != 2:
        raise TypeError(f"dropout_seed must be None or a pair (seed, offset) of ints, got {dropout_seed!r}")
    seed = check_int(dropout_seed[0], "dropout_seed's seed", 0, MAX_DROPOUT_SEED)
    offset = check_int(dropout_seed[1], "dropout_seed's offset", 0, MAX_DROPOUT_OFFSET - 1)
    return seed, offset


def draw_dropout_seed() -> tuple[int, int]:
    """A fresh ``(seed, offset)`` for dropout, drawn from torch's default CPU generator (so
    ``torch.manual_seed`` reproduces a call bit for bit, and nothing waits for a GPU).

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_validation.py.
    """
    import torch
    seed = int(torch.randint(0, MAX_DROPOUT_SEED, (1,), dtype=torch.int64))
    offset = int(torch.randint(0, MAX_DROPOUT_OFFSET, (1,), dtype=torch.int64))
    return seed, offset


# --- serving: ragged batches and paged caches (chapter 10) ------------------------------------------

def _host_values(x) -> bool:
    """Whether ``x``'s values may be read by the host: a plain CPU tensor outside torch.compile (a GPU
    tensor's read-back would make the host wait, and CUDA-graph capture forbids it; a FakeTensor or
    another subclass has no values to read)."""
    import torch
    return x.device.type == "cpu" and type(x) is torch.Tensor and not torch.compiler.is_compiling()


def check_varlen_tensors(q, k, v) -> None:
    """Check packed ``q (total_q, H, d)`` and ``k, v (total_k, Hkv, d)`` (token-major, flash-attn's
    varlen layout): torch tensors of one float dtype on one device, ``H % Hkv == 0``,
    ``1 <= d <= 256``, a contiguous last dim not required (any strides).

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    import torch
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must have shape (total_tokens, heads, d), 3 dims (packed "
                             f"sequences), got shape {tuple(x.shape)}")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    H, D = q.shape[1], q.shape[2]
    if k.shape[2] != D:
        raise ValueError(f"k must have the head dim of q ({D}), got k {tuple(k.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"the number of query heads H={H} must be a multiple of kv heads "
                         f"Hkv={k.shape[1]} (the heads of k); GQA: query head h reads kv head h // (H // Hkv)")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q's head dim must be between 1 and {MAX_HEAD_DIM}, got {D}")


def check_cu_seqlens(cu, name: str, total: int, q, batch: int | None = None):
    """A ragged batch's offsets: an int32 tensor ``(B + 1,)`` on q's device, starting at 0,
    non-decreasing, ending at ``total`` (the packed tokens' count), so that sequence b is rows
    ``cu[b]:cu[b + 1]``. The values are checked only where the host may read them (CPU tensors
    outside torch.compile); on a GPU the kernels clamp, as decode does with lengths. Returns it
    contiguous.

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    import torch
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (flash-attn's), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length B + 1 >= 1, got shape {tuple(cu.shape)}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} must have length B + 1 = {batch + 1} (as cu_seqlens_q), got "
                         f"{cu.numel()}")
    if cu.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {cu.device}")
    if _host_values(cu):
        vals = cu.tolist()
        if vals[0] != 0:
            raise ValueError(f"{name} must start at 0, got {vals[0]}")
        bad = next((b for b in range(len(vals) - 1) if vals[b + 1] < vals[b]), None)
        if bad is not None:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{bad}] = {vals[bad]} > "
                             f"{name}[{bad + 1}] = {vals[bad + 1]}")
        if vals[-1] != total:
            raise ValueError(f"{name} must end at the number of packed tokens ({total}), got "
                             f"{vals[-1]}")
    return cu.contiguous()


def check_max_seqlen(value, name: str, cu) -> int:
    """``max_seqlen_q`` / ``max_seqlen_k``: a host int >= 0 at least the longest sequence (it sizes
    the kernels' grids; checked against ``cu`` where the host may read it, never read from a GPU).

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    value = check_int(value, name, 0)
    if _host_values(cu) and cu.numel() > 1:
        longest = int((cu[1:] - cu[:-1]).max())
        if value < longest:
            raise ValueError(f"{name} must be at least the longest sequence ({longest}), got {value}")
    return value


def check_paged_cache(q, k_cache, v_cache) -> None:
    """Paged caches ``(num_pages, page_size, Hkv, d)`` (token-major pages, flash-attn's): float
    tensors of q's dtype and device, ``page_size >= 1``, ``num_pages >= 1``, ``H % Hkv == 0``.

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    import torch
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (num_pages, page_size, Hkv, d) with a "
                             f"block_table, got shape {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got "
                         f"{tuple(v_cache.shape)}")
    num_pages, page_size, hkv, d = k_cache.shape
    if page_size < 1:
        raise ValueError(f"k_cache's page size (dim 1) must be >= 1, got {page_size}")
    if num_pages < 1:
        raise ValueError(f"k_cache must hold at least one page, got {tuple(k_cache.shape)}")
    if d != q.shape[-1]:
        raise ValueError(f"k_cache must have the head dim of q ({q.shape[-1]}), got {tuple(k_cache.shape)}")
    if hkv < 1 or q.shape[1] % hkv:
        raise ValueError(f"the number of query heads H={q.shape[1]} must be a multiple of kv heads "
                         f"Hkv={hkv} (dim 2 of the paged k_cache)")


def check_block_table(block_table, q, num_pages: int):
    """A paged cache's block table: an int32 tensor ``(B, max_pages)`` on q's device; token t of
    sequence b lives in page ``block_table[b, t // page_size]``. Entries are checked (in
    ``[0, num_pages)``) by :func:`check_capacity`, for the pages a call reads, where the host may read
    them. Returns it.

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    import torch
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor of int32 or None, got "
                        f"{type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape ({q.shape[0]}, max_pages >= 1), got "
                         f"{tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on the device of q ({q.device}), got {block_table.device}")
    return block_table


def check_new_tokens(k, v, q, k_cache, paged: bool):
    """Decode's appended keys and values: ``(B, Hkv, Nnew, d)`` for a dense cache, ``(B, Nnew, Hkv,
    d)`` for a paged one (the cache's own token order), q's dtype and device. Returns Nnew.

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    import torch
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new tokens' keys and values), got "
                         f"k={'None' if k is None else 'a tensor'}, v={'None' if v is None else 'a tensor'}")
    hkv, d = (k_cache.shape[2], k_cache.shape[3]) if paged else (k_cache.shape[1], k_cache.shape[3])
    layout = "(B, Nnew, Hkv, d) for a paged cache" if paged else "(B, Hkv, Nnew, d) for a dense cache"
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
        if x.dim() != 4 or x.shape[0] != q.shape[0] or x.shape[2 if paged else 1] != hkv or x.shape[3] != d:
            raise ValueError(f"{name} must have shape {layout} with B={q.shape[0]}, Hkv={hkv}, "
                             f"d={d}, got {tuple(x.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    return k.shape[1] if paged else k.shape[2]


def check_capacity(cache_seqlens, n_new: int, capacity: int, block_table=None, page_size: int = 1,
                   num_pages: int = 0) -> None:
    """Where the host may read them: the lengths after appending ``n_new`` tokens fit the cache
    (``cache_seqlens[b] + n_new <= capacity``), and every block-table entry a call reads (the pages
    holding those tokens) lies in ``[0, num_pages)``. On a GPU nothing is read back: the kernels
    clamp lengths and page indices, and an append never writes past the capacity.

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    if n_new == 0 and block_table is None:
        return                                  # check_cache_seqlens has checked [0, capacity]
    if cache_seqlens is None:                   # the whole capacity: every table entry is read
        if block_table is None or not _host_values(block_table):
            return
        lens = [capacity] * block_table.shape[0]
    elif not _host_values(cache_seqlens) or cache_seqlens.numel() == 0:
        return
    else:
        lens = [int(n) + n_new for n in cache_seqlens.tolist()]
    if lens and max(lens) > capacity:
        b = max(range(len(lens)), key=lens.__getitem__)
        what = "appended tokens" if n_new else "cache_seqlens"
        raise ValueError(f"{what} past the cache's capacity ({capacity} tokens per sequence): "
                         f"sequence {b} would hold {lens[b]} (cache_seqlens[{b}] = {lens[b] - n_new} "
                         f"+ {n_new} new)")
    if block_table is None or not _host_values(block_table):
        return
    for b, n in enumerate(lens):
        pages = block_table[b, :-(-n // page_size)].tolist() if n else []
        bad = [p for p in pages if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"block_table[{b}] points past the cache's {num_pages} pages (entries "
                             f"must lie in [0, {num_pages})), got {bad[0]}")
