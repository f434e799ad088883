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

MAX_HEAD_DIM = 256          # the largest head dim every backend supports


def check_tensors(q, k, v, *, k_name: str = "k", v_name: str = "v") -> None:
    """Check ``q (B, H, Nq, d)`` and ``k, v (B, Hkv, Nk, d)``: torch tensors of one float dtype on
    one device, ``H % Hkv == 0`` (GQA), ``Nq, Nk >= 1`` and ``1 <= d <= 256``.

    ``k_name``, ``v_name``: how the messages call k and v (``"k_cache"`` for decode).
    Explained in: notebooks/11_beyond_one_gpu.
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

    Explained in: notebooks/11_beyond_one_gpu.
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

    Explained in: notebooks/11_beyond_one_gpu.
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

    Explained in: notebooks/11_beyond_one_gpu.
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
                   dropout_p=0.0, dropout_seed=None, op: str = "attention") -> dict:
    """The attention variants real models use (flash-attn's definitions; sinks FlashInfer's and
    gpt-oss's), checked: a dict holding only those not at their default, in the form the backends
    take (:class:`flashlib.backends.Backend`): ``window_size`` a pair of ints, ``softcap`` a float
    > 0, ``alibi_slopes`` float32 ``(B, H)`` contiguous (``(H,)`` expanded), ``sinks`` the caller's
    float32 ``(H,)`` tensor (autograd follows it; float64 inputs may give float64 slopes and sinks), ``dropout_p`` in (0, 1) with ``dropout_seed`` a
    pair ``(seed, offset)`` of ints (drawn by :func:`draw_dropout_seed` when None). ``op``
    "decode" refuses dropout (decode is inference). TypeError/ValueError naming the argument.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_validation.py.
    """
    B, H = q.shape[0], q.shape[1]
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
