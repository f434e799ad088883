"""The robustness suite: bad and odd inputs across flashlib's whole public surface, one row each.

Every row of :data:`CASES` is a call a careful user might make, and the class of answer it must get:

* ``("error", ExceptionType, regex)`` — a clear TypeError/ValueError (RuntimeError where the machine,
  not the input, is at fault) whose message matches ``regex``, which names the argument at fault;
* ``("usage", regex)`` — a command line (``python -m flashlib ...``, run in-process through
  ``flashlib.__main__.main``) that must exit with code 2 and argparse's ``error:`` message naming the
  option, never a traceback;
* ``("sdpa",)`` — a call of ``torch.nn.functional.scaled_dot_product_attention`` that must give, with
  :mod:`flashlib.auto` enabled, what plain SDPA gives: the same result, or the same exception type;
* ``("ok", checker)`` — a valid but unusual input that must work: ``checker(result)`` asserts the answer
  (an empty batch returns an empty tensor as SDPA does, meta tensors give shapes, huge ``num_splits`` is
  clamped and matches the oracle, NaN follows flashlib's one rule, ...).

The surface: the torch API (``flashlib.attention``, ``attention_qkvpacked``, ``decode``,
``default_num_splits``), the NumPy ladder (``naive``, ``softmax``, ``memeff``, ``fa1``, ``fa2``,
``decoding``, ``iomodel``), ``flashlib.auto``, ``flashlib.parallel.ring``, ``flashlib.puzzles``,
``flashlib.hardware`` and the command line. Shapes are tiny; the Triton rows (Triton's interpreter on a
CPU) are few. ``python tests/test_robustness.py`` (or :func:`summary`) prints the counts.
"""
from __future__ import annotations

import contextlib
import io
import math
import pathlib
import re
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass

if str(pathlib.Path(__file__).parent) not in sys.path:       # `import tests.test_robustness` from a shell
    sys.path.insert(0, str(pathlib.Path(__file__).parent))

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashlib
from conftest import DEVICE, require_module, require_tool
from flashlib import api, decoding, fa1, fa2, memeff, naive, softmax
from flashlib.ladder.iomodel import IOCounter

MIN_CASES = 150          # the table must stay at least this big (test_the_table_is_big)


@dataclass(frozen=True)
class Case:
    """One row: ``id``, a call ``fn()`` and the class of answer ``expect`` it must get; ``needs``:
    what the row needs ("g++": the CUDA emulator, "triton", "group": a one-rank gloo process group)."""
    id: str
    fn: object
    expect: tuple
    needs: tuple = ()


CASES: list[Case] = []


def err(id, fn, exc, pattern, needs=()):
    CASES.append(Case(id, fn, ("error", exc, pattern), tuple(needs)))


def ok(id, fn, check, needs=()):
    CASES.append(Case(id, fn, ("ok", check), tuple(needs)))


def sdpa(id, fn):
    CASES.append(Case(id, fn, ("sdpa",)))


def usage(id, argv, pattern):
    CASES.append(Case(id, lambda: _cli(*argv), ("usage", pattern)))


# ------------------------------------------------------------------------------------------ inputs

def T(*shape, dtype=torch.float32, device="cpu", seed=0):
    """A seeded normal tensor of ``shape`` (built when the row runs)."""
    g = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def qkv(B=1, H=2, HKV=1, NQ=5, NK=7, D=8, dtype=torch.float32, device="cpu"):
    return T(B, H, NQ, D, dtype=dtype, device=device, seed=1), \
        T(B, HKV, NK, D, dtype=dtype, device=device, seed=2), \
        T(B, HKV, NK, D, dtype=dtype, device=device, seed=3)


def A(*shape, dtype=np.float64, seed=0):
    """A seeded NumPy array of ``shape``."""
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(dtype)


def nqkv(NQ=5, NK=7, D=4, lead=(2,)):
    return A(*lead, NQ, D, seed=1), A(*lead, NK, D, seed=2), A(*lead, NK, D, seed=3)


def att(**kw):
    """flashlib.attention on the default small q, k, v, with ``kw`` replacing any argument."""
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, backend="reference") | kw
    return flashlib.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def dec(**kw):
    """flashlib.decode on a small cache (B=2, Nmax=10), with ``kw`` replacing any argument."""
    q, kc, vc = qkv(B=2, NQ=1, NK=10)
    args = dict(q=q, k_cache=kc, v_cache=vc, backend="reference") | kw
    return flashlib.decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def oracle(q, k, v, causal=False, scale=None):
    """float64 attention of torch tensors (GQA by repeating kv heads), as a float64 CPU tensor."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().cpu().repeat_interleave(g, dim=1) for x in (k, v))
    o, _lse = flashlib.testing.reference(q.double().cpu().numpy(), k.numpy(), v.numpy(), causal=causal,
                                         scale=scale)
    return torch.from_numpy(o)


def close_to(expected_fn, atol=2e-5):
    """A checker: the result (``o`` or ``(o, lse)``) equals ``expected_fn()`` within ``atol``."""
    def check(got):
        o = got[0] if isinstance(got, tuple) else got
        exp = expected_fn()
        assert torch.allclose(o.double().cpu(), exp.double().cpu(), atol=atol, equal_nan=True), \
            f"max error {(o.double().cpu() - exp.double().cpu()).abs().max()}"
    return check


def np_close_to(expected_fn, atol=1e-10):
    def check(got):
        o, exp = (x[0] if isinstance(x, tuple) else x for x in (got, expected_fn()))
        np.testing.assert_allclose(o, exp, atol=atol)
    return check


def empty_like_sdpa(shape):
    """A checker: an empty tensor of ``shape``, as SDPA returns for an empty batch."""
    def check(got):
        o = got[0] if isinstance(got, tuple) else got
        assert isinstance(o, torch.Tensor) and tuple(o.shape) == tuple(shape) and o.numel() == 0
    return check


def meta_of(shape, lse_shape=None):
    """A checker: meta tensors of ``shape`` (and lse of ``lse_shape``), as the fake implementations give."""
    def check(got):
        o, lse = got if isinstance(got, tuple) else (got, None)
        assert o.device.type == "meta" and tuple(o.shape) == tuple(shape), (o.device, o.shape)
        if lse_shape is not None:
            assert lse.device.type == "meta" and tuple(lse.shape) == tuple(lse_shape)
    return check


def nan_rows(rows, finite_rest=True):
    """A checker for NaN inputs: ``(o, lse)`` NaN exactly in query ``rows`` (all heads), finite elsewhere
    (flashlib's one rule: a NaN a row sees makes the row NaN; nothing else changes)."""
    def check(got):
        o, lse = got
        o, lse = o.double().cpu(), lse.double().cpu()
        for r in rows:
            assert torch.isnan(o[..., r, :]).all(), f"o row {r} is not NaN: {o[..., r, :]}"
            assert torch.isnan(lse[..., r]).all(), f"lse row {r} is not NaN: {lse[..., r]}"
        if finite_rest:
            keep = [i for i in range(o.shape[-2]) if i not in rows]
            assert torch.isfinite(o[..., keep, :]).all() and torch.isfinite(lse[..., keep]).all()
    return check


def with_nan(x, index):
    x = x.copy() if isinstance(x, np.ndarray) else x.clone()
    x[index] = float("nan")
    return x


def _cli(*argv):
    """``python -m flashlib *argv`` in-process: ``(exit code, stderr)``; a traceback is part of stderr."""
    from flashlib.__main__ import main
    out, errs = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errs):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:                   # noqa: BLE001 - a traceback is the failure we report
            traceback.print_exc()
            code = "traceback"
    return code, errs.getvalue()


# ===================================================================== torch API: flashlib.attention

BAD_TYPE = ("q", "k", "v")
for name in BAD_TYPE:
    err(f"attention-{name}-numpy", lambda n=name: att(**{n: np.zeros((1, 2, 5, 8), np.float32)}),
        TypeError, rf"\b{name} must be a torch\.Tensor")
err("attention-q-list", lambda: att(q=[[1.0]]), TypeError, r"q must be a torch\.Tensor")
err("attention-k-none", lambda: att(k=None), TypeError, r"k must be a torch\.Tensor")
err("attention-v-str", lambda: att(v="v"), TypeError, r"v must be a torch\.Tensor")
err("attention-q-3d", lambda: att(q=T(2, 5, 8)), ValueError, r"q must have shape \(B, H, N, d\)")
err("attention-k-5d", lambda: att(k=T(1, 1, 1, 7, 8)), ValueError, r"k must have shape")
err("attention-v-2d", lambda: att(v=T(7, 8)), ValueError, r"v must have shape")
err("attention-q-0d", lambda: att(q=torch.tensor(1.0)), ValueError, r"q must have shape")
err("attention-q-int32", lambda: att(q=torch.ones(1, 2, 5, 8, dtype=torch.int32)), TypeError,
    r"q must be float16, bfloat16, float32 or float64, got torch\.int32")
err("attention-q-bool", lambda: att(q=torch.ones(1, 2, 5, 8, dtype=torch.bool)), TypeError, r"q must be")
err("attention-q-complex", lambda: att(q=torch.ones(1, 2, 5, 8, dtype=torch.complex64)), TypeError,
    r"q must be float16")
err("attention-k-fp16-q-fp32", lambda: att(k=T(1, 1, 7, 8, dtype=torch.float16)), TypeError,
    r"k must have the dtype of q")
err("attention-v-bf16", lambda: att(v=T(1, 1, 7, 8, dtype=torch.bfloat16)), TypeError,
    r"v must have the dtype of q")
err("attention-k-on-meta", lambda: att(k=T(1, 1, 7, 8).to("meta")), ValueError,
    r"k must be on the device of q")
err("attention-batch-mismatch", lambda: att(k=T(2, 1, 7, 8), v=T(2, 1, 7, 8)), ValueError,
    r"k must have the batch size of q")
err("attention-v-shape-mismatch", lambda: att(v=T(1, 1, 6, 8)), ValueError, r"v must have the shape of k")
err("attention-headdim-mismatch", lambda: att(k=T(1, 1, 7, 4), v=T(1, 1, 7, 4)), ValueError,
    r"k must have the head dim of q")
err("attention-gqa-3-over-2", lambda: att(q=T(1, 3, 5, 8), k=T(1, 2, 7, 8), v=T(1, 2, 7, 8)), ValueError,
    r"H=3 must be a multiple of kv heads Hkv=2")
err("attention-hkv-zero", lambda: att(k=T(1, 0, 7, 8), v=T(1, 0, 7, 8)), ValueError, r"Hkv=0")
err("attention-more-kv-heads", lambda: att(k=T(1, 4, 7, 8), v=T(1, 4, 7, 8)), ValueError, r"Hkv=4")
err("attention-nq-zero", lambda: att(q=T(1, 2, 0, 8)), ValueError, r"q must hold at least one query")
err("attention-nk-zero", lambda: att(k=T(1, 1, 0, 8), v=T(1, 1, 0, 8)), ValueError,
    r"k and v must hold at least one key")
err("attention-d-zero", lambda: att(q=T(1, 2, 5, 0), k=T(1, 1, 7, 0), v=T(1, 1, 7, 0)), ValueError,
    r"head dim must be between 1 and 256, got 0")
err("attention-d-300", lambda: att(q=T(1, 2, 5, 300), k=T(1, 1, 7, 300), v=T(1, 1, 7, 300)), ValueError,
    r"head dim must be between 1 and 256, got 300")
for value in ("False", "True", 1, 0, None, 2.0, [True], torch.tensor(True), np.int64(1)):
    err(f"attention-causal-{type(value).__name__}-{value!r}"[:48], lambda x=value: att(causal=x),
        TypeError, r"causal must be a bool")
for value in (1, "yes", None):
    err(f"attention-return_lse-{value!r}", lambda x=value: att(return_lse=x), TypeError,
        r"return_lse must be a bool")
for value in (0, "no", None):
    err(f"attention-allow_tf32-{value!r}", lambda x=value: att(allow_tf32=x), TypeError,
        r"allow_tf32 must be a bool")
for value in (float("nan"), float("inf"), -float("inf")):
    err(f"attention-scale-{value}", lambda x=value: att(scale=x), ValueError, r"scale must be finite")
for value in ("0.1", True, complex(1, 0), [0.1], torch.tensor(0.5)):
    err(f"attention-scale-{type(value).__name__}", lambda x=value: att(scale=x), TypeError,
        r"scale must be a real number")
for value in ("nope", "Triton", "", "sdpa", "auto "):
    err(f"attention-backend-{value!r}", lambda x=value: att(backend=x), ValueError,
        r"backend must be one of \['auto', 'cuda', 'reference', 'triton'\]")
for value in (None, 1, ["reference"]):
    err(f"attention-backend-{type(value).__name__}", lambda x=value: att(backend=x), TypeError,
        r"backend must be a str")
err("attention-float64-on-triton", lambda: att(*(), q=T(1, 2, 5, 8, dtype=torch.float64, device=DEVICE),
                                                k=T(1, 1, 7, 8, dtype=torch.float64, device=DEVICE),
                                                v=T(1, 1, 7, 8, dtype=torch.float64, device=DEVICE),
                                                backend="triton"),
    TypeError, r"float64", needs=("triton",))
for name in ("block_q", "block_k"):
    err(f"attention-{name}-zero", lambda n=name: att(**{n: 0}), ValueError, rf"{name} must be a positive int")
    err(f"attention-{name}-negative", lambda n=name: att(**{n: -16}), ValueError, rf"{name} must be")
    err(f"attention-{name}-str", lambda n=name: att(**{n: "64"}), TypeError,
        rf"{name} must be a positive int")
    err(f"attention-{name}-float", lambda n=name: att(**{n: 16.0}), TypeError, rf"{name} must be")
    err(f"attention-{name}-bool", lambda n=name: att(**{n: True}), TypeError, rf"{name} must be")
err("attention-triton-block_q-24", lambda: att(q=T(1, 2, 5, 8, device=DEVICE), k=T(1, 1, 7, 8, device=DEVICE),
                                               v=T(1, 1, 7, 8, device=DEVICE), backend="triton", block_q=24),
    ValueError, r"block_q", needs=("triton",))
err("attention-unknown-keyword", lambda: att(is_causal=True), TypeError, r"is_causal")
err("attention-positional-causal", lambda: flashlib.attention(*qkv(), True), TypeError, r"positional")

# valid odd inputs of attention
ok("attention-causal-np.bool_", lambda: att(causal=np.bool_(True)),
   close_to(lambda: oracle(*qkv(), causal=True)))
ok("attention-return_lse-np.bool_", lambda: att(return_lse=np.bool_(False)),
   close_to(lambda: oracle(*qkv())))
ok("attention-scale-int", lambda: att(scale=1), close_to(lambda: oracle(*qkv(), scale=1.0)))
ok("attention-scale-np.float32", lambda: att(scale=np.float32(0.25)),
   close_to(lambda: oracle(*qkv(), scale=0.25)))
ok("attention-scale-zero", lambda: att(scale=0.0), close_to(lambda: oracle(*qkv(), scale=0.0)))
ok("attention-scale-negative", lambda: att(scale=-0.3), close_to(lambda: oracle(*qkv(), scale=-0.3)))
ok("attention-block-np.int64", lambda: att(block_q=np.int64(2), block_k=np.int64(3)),
   close_to(lambda: oracle(*qkv())))
ok("attention-block-bigger-than-N", lambda: att(block_q=10**6, block_k=10**6),
   close_to(lambda: oracle(*qkv())))
ok("attention-noncontiguous", lambda: att(q=qkv(NQ=5)[0].transpose(2, 3).contiguous().transpose(2, 3)),
   close_to(lambda: oracle(*qkv())))
ok("attention-d-1", lambda: att(q=T(1, 2, 5, 1), k=T(1, 1, 7, 1), v=T(1, 1, 7, 1)),
   close_to(lambda: oracle(T(1, 2, 5, 1), T(1, 1, 7, 1), T(1, 1, 7, 1))))
ok("attention-causal-nq>nk-empty-rows", lambda: att(q=T(1, 2, 9, 8), causal=True, return_lse=True),
   lambda got: (torch.all(got[0][..., :2, :] == 0) and torch.isneginf(got[1][..., :2]).all())
   or pytest.fail(f"rows that see no key must give o = 0 and lse = -inf, got {got[1][..., :2]}"))
for backend in ("reference", "triton", "cuda"):
    needs = {"reference": (), "triton": ("triton",), "cuda": ("g++",)}[backend]
    dev = DEVICE if backend == "triton" else "cpu"
    ok(f"attention-B0-{backend}", lambda b=backend, d=dev: flashlib.attention(*qkv(B=0, device=d), backend=b),
       empty_like_sdpa((0, 2, 5, 8)), needs)
    ok(f"attention-meta-{backend}",
       lambda b=backend: flashlib.attention(*(x.to("meta") for x in qkv()), backend=b, return_lse=True),
       meta_of((1, 2, 5, 8), (1, 2, 5)))
ok("attention-meta-auto", lambda: flashlib.attention(*(x.to("meta") for x in qkv())), meta_of((1, 2, 5, 8)))
ok("attention-B0-backward", lambda: (lambda q, k, v: (flashlib.attention(q, k, v, backend="reference")
                                                     .sum().backward(), q.grad))(
    *(x.requires_grad_() for x in qkv(B=0))),
   lambda got: got[1] is not None and got[1].shape == (0, 2, 5, 8) or pytest.fail(f"grad {got[1]}"))

# NaN follows flashlib's one rule on every backend (notebooks/appendix_contract)
for backend in ("reference", "triton", "cuda"):
    needs = {"reference": (), "triton": ("triton",), "cuda": ("g++",)}[backend]
    dev = DEVICE if backend == "triton" else "cpu"

    def _nan_q(b=backend, d=dev):
        q, k, v = qkv(NQ=4, NK=6, D=16, device=d)
        return flashlib.attention(with_nan(q, (0, slice(None), 1)), k, v, backend=b, return_lse=True)

    ok(f"attention-nan-q-row-{backend}", _nan_q, nan_rows([1]), needs)

    def _nan_masked_v(b=backend, d=dev):           # a NaN value behind the causal mask changes nothing
        q, k, v = qkv(NQ=4, NK=4, D=16, device=d)
        o = flashlib.attention(q, k, with_nan(v, (0, 0, 3)), causal=True, backend=b)
        return o[..., :3, :], flashlib.attention(q, k, v, causal=True, backend=b)[..., :3, :]

    ok(f"attention-nan-v-behind-mask-{backend}", _nan_masked_v,
       lambda got: torch.equal(got[0], got[1]) or pytest.fail("a masked NaN value changed visible rows"),
       needs)

# =========================================================== torch API: flashlib.attention_qkvpacked

err("qkvpacked-numpy", lambda: flashlib.attention_qkvpacked(np.zeros((1, 5, 3, 2, 8))), TypeError,
    r"qkv must be a torch\.Tensor")
err("qkvpacked-4d", lambda: flashlib.attention_qkvpacked(T(1, 5, 3, 8)), ValueError,
    r"qkv must have shape \(B, N, 3, H, d\)")
err("qkvpacked-two-not-three", lambda: flashlib.attention_qkvpacked(T(1, 5, 2, 2, 8)), ValueError,
    r"qkv must have shape")
err("qkvpacked-int", lambda: flashlib.attention_qkvpacked(torch.ones(1, 5, 3, 2, 8, dtype=torch.int64)),
    TypeError, r"\bq(kv)? must")
err("qkvpacked-causal-str", lambda: flashlib.attention_qkvpacked(T(1, 5, 3, 2, 8), causal="no"),
    TypeError, r"causal must be a bool")
err("qkvpacked-scale-nan", lambda: flashlib.attention_qkvpacked(T(1, 5, 3, 2, 8), scale=math.nan),
    ValueError, r"scale must be finite")
err("qkvpacked-backend", lambda: flashlib.attention_qkvpacked(T(1, 5, 3, 2, 8), backend="fast"),
    ValueError, r"backend must be one of")
ok("qkvpacked-B0", lambda: flashlib.attention_qkvpacked(T(0, 5, 3, 2, 8), backend="reference"),
   empty_like_sdpa((0, 5, 2, 8)))
ok("qkvpacked-causal-np.bool_",
   lambda: flashlib.attention_qkvpacked(T(1, 5, 3, 2, 8), causal=np.bool_(True), backend="reference"),
   close_to(lambda: oracle(*(T(1, 5, 3, 2, 8)[:, :, i].transpose(1, 2) for i in range(3)),
                           causal=True).transpose(1, 2)))

# ========================================================================= torch API: flashlib.decode

err("decode-seqlens-list", lambda: dec(cache_seqlens=[3, 4]), TypeError,
    r"cache_seqlens must be a torch\.Tensor")
err("decode-seqlens-numpy", lambda: dec(cache_seqlens=np.array([3, 4])), TypeError,
    r"cache_seqlens must be a torch\.Tensor")
err("decode-seqlens-float", lambda: dec(cache_seqlens=torch.tensor([3.0, 4.0])), TypeError,
    r"cache_seqlens must have dtype int32 or int64")
err("decode-seqlens-int16", lambda: dec(cache_seqlens=torch.tensor([3, 4], dtype=torch.int16)), TypeError,
    r"cache_seqlens must have dtype")
err("decode-seqlens-bool", lambda: dec(cache_seqlens=torch.tensor([True, True])), TypeError,
    r"cache_seqlens must have dtype")
err("decode-seqlens-short", lambda: dec(cache_seqlens=torch.tensor([3])), ValueError,
    r"cache_seqlens must have shape \(2,\)")
err("decode-seqlens-2d", lambda: dec(cache_seqlens=torch.tensor([[3, 4]])), ValueError,
    r"cache_seqlens must have shape \(2,\)")
err("decode-seqlens-0d", lambda: dec(cache_seqlens=torch.tensor(3)), ValueError, r"cache_seqlens must have")
err("decode-seqlens-negative", lambda: dec(cache_seqlens=torch.tensor([-1, 4])), ValueError,
    r"cache_seqlens must lie in \[0, 10\]")
err("decode-seqlens-past-nmax", lambda: dec(cache_seqlens=torch.tensor([3, 11])), ValueError,
    r"cache_seqlens must lie in \[0, 10\]")
err("decode-seqlens-2**32+3-eager-cpu", lambda: dec(cache_seqlens=torch.tensor([2**32 + 3, 4])), ValueError,
    r"cache_seqlens must lie in \[0, 10\]")
err("decode-seqlens-on-meta", lambda: dec(cache_seqlens=torch.tensor([3, 4], device="meta")), ValueError,
    r"cache_seqlens must be on the device of q")
for value, exc in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError),
                   ("4", TypeError), (np.float64(2), TypeError)):
    err(f"decode-num_splits-{type(value).__name__}-{value!r}"[:48], lambda x=value: dec(num_splits=x), exc,
        r"num_splits must be an int >= 1")
err("decode-requires-grad", lambda: dec(q=T(2, 2, 1, 8).requires_grad_()), ValueError,
    r"decode is inference-only.*requires grad")
err("decode-scale-nan", lambda: dec(scale=math.nan), ValueError, r"scale must be finite")
err("decode-scale-str", lambda: dec(scale="1"), TypeError, r"scale must be a real number")
err("decode-return_lse-str", lambda: dec(return_lse="yes"), TypeError, r"return_lse must be a bool")
err("decode-backend", lambda: dec(backend="flash"), ValueError, r"backend must be one of")
err("decode-q-numpy", lambda: dec(q=np.zeros((2, 2, 1, 8), np.float32)), TypeError,
    r"q must be a torch\.Tensor")
err("decode-kcache-fp16", lambda: dec(k_cache=T(2, 1, 10, 8, dtype=torch.float16)), TypeError,
    r"k_cache must have the dtype of q")
err("decode-vcache-shape", lambda: dec(v_cache=T(2, 1, 9, 8)), ValueError,
    r"v_cache must have the shape of k_cache")
err("decode-kcache-heads", lambda: dec(k_cache=T(2, 3, 10, 8), v_cache=T(2, 3, 10, 8)), ValueError,
    r"Hkv=3 \(the heads of k_cache\)")
err("decode-kcache-empty", lambda: dec(k_cache=T(2, 1, 0, 8), v_cache=T(2, 1, 0, 8)), ValueError,
    r"k_cache and v_cache must hold at least one key")
err("decode-causal-not-bool", lambda: dec(causal="yes"), TypeError, r"causal")
err("decode-k-without-cache_seqlens", lambda: dec(k=T(2, 1, 1, 8), v=T(2, 1, 1, 8)), ValueError,
    r"k and v \(new tokens to append\) need cache_seqlens")
err("decode-block_table-int64", lambda: dec(k_cache=T(4, 5, 1, 8), v_cache=T(4, 5, 1, 8),
                                             block_table=torch.zeros(2, 1, dtype=torch.int64)),
    TypeError, r"block_table must have dtype torch.int32")

ok("decode-num_splits-np.int64", lambda: dec(num_splits=np.int64(3)),
   close_to(lambda: oracle(*qkv(B=2, NQ=1, NK=10))))
ok("decode-return_lse-np.bool_", lambda: dec(return_lse=np.bool_(True)),
   close_to(lambda: oracle(*qkv(B=2, NQ=1, NK=10))))
ok("decode-seqlens-zero-length", lambda: dec(cache_seqlens=torch.tensor([0, 10]), return_lse=True),
   lambda got: (torch.all(got[0][0] == 0) and torch.isneginf(got[1][0]).all())
   or pytest.fail("a sequence of length 0 must give o = 0 and lse = -inf"))
for backend in ("reference", "triton", "cuda"):
    needs = {"reference": (), "triton": ("triton",), "cuda": ("g++",)}[backend]
    dev = DEVICE if backend == "triton" else "cpu"
    ok(f"decode-num_splits-1e9-{backend}",
       lambda b=backend, d=dev: flashlib.decode(*qkv(B=2, NQ=1, NK=10, device=d), num_splits=10**9,
                                                backend=b),
       close_to(lambda: oracle(*qkv(B=2, NQ=1, NK=10))), needs)
    ok(f"decode-B0-{backend}",
       lambda b=backend, d=dev: flashlib.decode(*qkv(B=0, NQ=1, NK=10, device=d), backend=b),
       empty_like_sdpa((0, 2, 1, 8)), needs)
    ok(f"decode-meta-{backend}",
       lambda b=backend: flashlib.decode(*(x.to("meta") for x in qkv(B=2, NQ=1, NK=10)), backend=b,
                                         return_lse=True),
       meta_of((2, 2, 1, 8), (2, 2, 1)))

    def _nan_q_dec(b=backend, d=dev, dtype=torch.float32):   # a NaN query row: that row NaN
        q, kc, vc = qkv(B=1, NQ=3, NK=40, D=16, device=d, dtype=dtype)
        return flashlib.decode(with_nan(q, (0, 1, 2, 5)), kc, vc, num_splits=3, backend=b, return_lse=True)

    def _nan_k_dec(b=backend, d=dev):                          # a NaN key every row sees: all rows NaN
        q, kc, vc = qkv(B=1, NQ=2, NK=40, D=16, device=d)
        return flashlib.decode(q, with_nan(kc, (0, 0, 3, 0)), vc, num_splits=4, backend=b, return_lse=True)

    def _nan_past_len(b=backend, d=dev):                       # NaN past cache_seqlens changes nothing
        q, kc, vc = qkv(B=1, NQ=2, NK=40, D=16, device=d)
        lens = torch.tensor([20], device=d)
        o = flashlib.decode(q, with_nan(kc, (0, 0, 30)), with_nan(vc, (0, 0, 33)), cache_seqlens=lens,
                            num_splits=3, backend=b)
        return o, flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=3, backend=b)

    def _nan_row_only(got):
        o, lse = got
        assert torch.isnan(o[0, 1, 2]).all() and torch.isnan(lse[0, 1, 2]), (o[0, 1, 2], lse[0, 1, 2])
        assert torch.isfinite(o[0, 0]).all() and torch.isfinite(o[0, 1, :2]).all()

    ok(f"decode-nan-q-row-{backend}", _nan_q_dec, _nan_row_only, needs)
    ok(f"decode-nan-k-{backend}", _nan_k_dec, nan_rows([0, 1]), needs)
    ok(f"decode-nan-past-seqlens-{backend}", _nan_past_len,
       lambda got: torch.equal(got[0], got[1]) or pytest.fail("NaN past cache_seqlens changed o"), needs)
for dtype in (torch.float16, torch.bfloat16):
    ok(f"decode-nan-q-row-cuda-{str(dtype)[6:]}",
       lambda dt=dtype: (lambda q, kc, vc: flashlib.decode(with_nan(q, (0, 1, 2, 5)), kc, vc, num_splits=3,
                                                          backend="cuda", return_lse=True))(
           *qkv(B=1, NQ=3, NK=40, D=16, dtype=dt)),
       lambda got: torch.isnan(got[0][0, 1, 2]).all() and torch.isnan(got[1][0, 1, 2])
       or pytest.fail(f"o {got[0][0, 1, 2]}, lse {got[1][0, 1, 2]}"), ("g++",))
ok("decode-num_splits-10**30", lambda: dec(num_splits=10**30),
   close_to(lambda: oracle(*qkv(B=2, NQ=1, NK=10))))


def _compiled_decode(backend, lens):
    """decode under torch.compile (dynamo, eager backend): the no-read-back path on a CPU."""
    q, kc, vc = qkv(B=2, NQ=1, NK=10, device=DEVICE if backend == "triton" else "cpu")
    fn = torch.compile(lambda q, k, v, n: flashlib.decode(q, k, v, cache_seqlens=n, num_splits=2,
                                                          backend=backend), backend="eager")
    torch._dynamo.reset()
    return fn(q, kc, vc, lens.to(q.device))


def _backend_decode(backend, lens):
    """A backend's decode as every GPU call reaches it: lengths never read back by the validator."""
    from flashlib.backends import BACKENDS
    q, kc, vc = qkv(B=2, NQ=1, NK=10, device=DEVICE if backend == "triton" else "cpu")
    return BACKENDS[backend].decode(q, kc, vc, lens.to(q.device), num_splits=2, scale=8 ** -0.5)


HUGE_LENS = torch.tensor([2**32 + 3, 2**31 + 5], dtype=torch.int64)     # int32 wrap: 3 and -2**31 + 5
for backend in ("reference", "triton"):
    needs = {"reference": (), "triton": ("triton",)}[backend]
    ok(f"decode-seqlens-2**32+3-clamps-{backend}", lambda b=backend: _backend_decode(b, HUGE_LENS),
       close_to(lambda: oracle(*qkv(B=2, NQ=1, NK=10))), needs)
    ok(f"decode-seqlens-negative-clamps-{backend}",
       lambda b=backend: _backend_decode(b, torch.tensor([-7, -2**40])),
       lambda got: torch.all(got[0] == 0) or pytest.fail(f"a negative length must clamp to 0: {got[0]}"),
       needs)
# The CUDA backend's entry point (flashlib.kernels.cuda) checks CPU tensors' lengths itself: on a CPU (its
# emulator) a length outside [0, Nmax] is refused there, never wrapped.
err("decode-seqlens-2**32+3-cuda-on-cpu", lambda: _backend_decode("cuda", HUGE_LENS), ValueError,
    r"cache_seqlens must lie in \[0, 10\]", needs=("g++",))
ok("decode-seqlens-2**32+3-clamps-compiled", lambda: _compiled_decode("reference", HUGE_LENS),
   close_to(lambda: oracle(*qkv(B=2, NQ=1, NK=10))))
ok("decode-seqlens-negative-clamps-compiled", lambda: _compiled_decode("reference", torch.tensor([-7, 10])),
   lambda got: torch.all(got[0] == 0) or pytest.fail(f"a negative length must clamp to 0: {got[0]}"))

# ================================================================ torch API: default_num_splits

ok("default_num_splits-exported", lambda: flashlib.default_num_splits(*qkv(B=2, NQ=1, NK=1000)[:2]),
   lambda n: isinstance(n, int) and n >= 1 or pytest.fail(f"got {n!r}"))
ok("default_num_splits-in-__all__", lambda: flashlib.__all__,
   lambda names: "default_num_splits" in names or pytest.fail("flashlib.__all__ lacks default_num_splits"))
err("default_num_splits-q-none", lambda: flashlib.default_num_splits(None, T(1, 1, 10, 8)), TypeError,
    r"\bq must be a torch\.Tensor")
err("default_num_splits-q-numpy", lambda: api.default_num_splits(np.zeros((1, 2, 1, 8)), T(1, 1, 10, 8)),
    TypeError, r"\bq must be a torch\.Tensor")
err("default_num_splits-kcache-str", lambda: api.default_num_splits(T(1, 2, 1, 8), "k"), TypeError,
    r"k_cache must be a torch\.Tensor")
err("default_num_splits-q-3d", lambda: api.default_num_splits(T(2, 1, 8), T(1, 1, 10, 8)), ValueError,
    r"\bq must have shape")
err("default_num_splits-kcache-2d", lambda: api.default_num_splits(T(1, 2, 1, 8), T(10, 8)), ValueError,
    r"k_cache must have shape")
err("default_num_splits-H3-Hkv2", lambda: api.default_num_splits(T(1, 3, 1, 8), T(1, 2, 10, 8)), ValueError,
    r"H=3 must be a multiple of kv heads Hkv=2")
err("default_num_splits-Hkv0", lambda: api.default_num_splits(T(1, 2, 1, 8), T(1, 0, 10, 8)), ValueError,
    r"Hkv=0")
err("default_num_splits-batch", lambda: api.default_num_splits(T(1, 2, 1, 8), T(3, 1, 10, 8)), ValueError,
    r"k_cache must have the batch size of q")

# ============================================================================ the NumPy ladder

LADDER = {   # name -> call(q, k, v, **kw) of every ladder function that takes causal
    "naive.attention": lambda q, k, v, **kw: naive.attention(q, k, v, **kw),
    "naive.backward": lambda q, k, v, **kw: naive.backward(q, k, v, A(*q.shape[:-1], v.shape[-1]),
                                                           A(*q.shape[:-1], v.shape[-1], seed=5), **kw),
    "memeff.lse_first": lambda q, k, v, **kw: memeff.lse_first(q, k, v, **kw),
    "memeff.chunked": lambda q, k, v, **kw: memeff.chunked(q, k, v, query_chunk=2, key_chunk=3, **kw),
    "fa1.forward": lambda q, k, v, **kw: fa1.forward(q, k, v, block_q=2, block_k=3, **kw),
    "fa2.forward": lambda q, k, v, **kw: fa2.forward(q, k, v, block_q=2, block_k=3, **kw),
    "fa2.backward": lambda q, k, v, **kw: fa2.backward(q, k, v, *fa2.forward(q, k, v), A(*q.shape, seed=6),
                                                       **kw),
    "decoding.forward": lambda q, k, v, **kw: decoding.forward(q, k, v, num_splits=3, **kw),
}


def _first(x):
    return x[0] if isinstance(x, tuple) else x


for fname, call in LADDER.items():
    for value in ("False", "True", 2, 1, 0, None, 1.0, [False]):
        err(f"{fname}-causal-{type(value).__name__}-{value!r}", lambda c=call, x=value: c(*nqkv(), causal=x),
            TypeError, r"causal must be a bool")
    ok(f"{fname}-causal-np.bool_", lambda c=call: c(*nqkv(), causal=np.bool_(True)),
       lambda got, c=call: np.testing.assert_array_equal(_first(got), _first(c(*nqkv(), causal=True))))
    err(f"{fname}-scale-nan", lambda c=call: c(*nqkv(), scale=math.nan), ValueError, r"scale must be finite")
    err(f"{fname}-scale-str", lambda c=call: c(*nqkv(), scale="0.5"), TypeError, r"scale must be a real")
    err(f"{fname}-io-str", lambda c=call: c(*nqkv(), io="counter"), TypeError, r"io must be")
    err(f"{fname}-q-torch", lambda c=call: c(torch.zeros(2, 5, 4, dtype=torch.float64), *nqkv()[1:]),
        TypeError, r"q must be a NumPy array")
err("fa2.forward-q-int", lambda: fa2.forward(np.ones((2, 5, 4), int), *nqkv()[1:]), TypeError,
    r"q must have a real floating dtype")
err("fa2.forward-q-complex", lambda: fa2.forward(np.ones((2, 5, 4), complex), *nqkv()[1:]), TypeError,
    r"q must have a real floating dtype")
err("fa2.forward-q-1d", lambda: fa2.forward(A(4), *nqkv()[1:]), ValueError, r"q must have shape")
err("fa2.forward-q-dict", lambda: fa2.forward({}, *nqkv()[1:]), TypeError, r"q must be a NumPy array")
err("fa2.forward-k-headdim", lambda: fa2.forward(nqkv()[0], A(2, 7, 3), A(2, 7, 4)), ValueError,
    r"k must have the head dim of q")
err("fa2.forward-v-rows", lambda: fa2.forward(*nqkv()[:2], A(2, 6, 4)), ValueError,
    r"v must have as many rows")
err("fa2.forward-lead-dims", lambda: fa2.forward(A(3, 5, 4), *nqkv()[1:]), ValueError,
    r"q, k and v must share their leading dims")
err("fa2.forward-nq-zero", lambda: fa2.forward(A(2, 0, 4), *nqkv()[1:]), ValueError, r"q must hold at least")
err("fa2.forward-nk-zero", lambda: fa2.forward(nqkv()[0], A(2, 0, 4), A(2, 0, 4)), ValueError,
    r"k and v must hold at least one key")
err("fa2.forward-d-zero", lambda: fa2.forward(A(2, 5, 0), A(2, 7, 0), A(2, 7, 4)), ValueError,
    r"head dim d >= 1")
for name in ("block_q", "block_k"):
    for value, exc in ((0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError),
                       ("8", TypeError)):
        err(f"fa2.forward-{name}-{value!r}", lambda n=name, x=value: fa2.forward(*nqkv(), **{n: x}), exc,
            rf"{name} must be a positive int")
        err(f"fa1.forward-{name}-{value!r}", lambda n=name, x=value: fa1.forward(*nqkv(), **{n: x}), exc,
            rf"{name} must be a positive int")
err("fa2.backward-lse-shape", lambda: fa2.backward(*nqkv(), A(2, 5, 4), A(2, 4), A(2, 5, 4)), ValueError,
    r"lse must have shape")
err("fa2.backward-do-shape", lambda: fa2.backward(*nqkv(), A(2, 5, 4), A(2, 5), A(2, 5, 3)), ValueError,
    r"do must have shape")
err("fa2.backward-o-shape", lambda: fa2.backward(*nqkv(), A(2, 4, 4), A(2, 5), A(2, 5, 4)), ValueError,
    r"\bo must have shape")
err("naive.backward-do-shape", lambda: naive.backward(*nqkv(), A(2, 5, 4), A(2, 6, 4)), ValueError,
    r"do must have shape")
for name in ("block_k",):
    err(f"memeff.lse_first-{name}-0", lambda: memeff.lse_first(*nqkv(), block_k=0), ValueError,
        r"block_k must be a positive int")
err("memeff.chunked-query_chunk-0", lambda: memeff.chunked(*nqkv(), query_chunk=0), ValueError,
    r"query_chunk must be a positive int")
err("memeff.chunked-key_chunk-str", lambda: memeff.chunked(*nqkv(), key_chunk="4"), TypeError,
    r"key_chunk must be a positive int")
err("memeff.chunked-key_chunk-None", lambda: memeff.chunked(*nqkv(), key_chunk=None), (TypeError, ValueError),
    r"key_chunk")
for value, exc in ((0, ValueError), (-1, ValueError), (1.5, TypeError), ("4096", TypeError)):
    err(f"fa1.forward-sram_bytes-{value!r}", lambda x=value: fa1.forward(*nqkv(), sram_bytes=x), exc,
        r"sram_bytes")
err("fa1.forward-sram_bytes-too-small", lambda: fa1.forward(*nqkv(), sram_bytes=16), ValueError,
    r"sram_bytes=16 is too small")
err("fa1.paper_block_sizes-d-0", lambda: fa1.paper_block_sizes(1000, 0), ValueError, r"\bd must be")
err("fa1.paper_block_sizes-d-neg", lambda: fa1.paper_block_sizes(1000, -4), ValueError, r"\bd must be")
err("fa1.paper_block_sizes-bpe-0", lambda: fa1.paper_block_sizes(1000, 8, 0), ValueError,
    r"bytes_per_element must be")
err("fa1.paper_block_sizes-sram-0", lambda: fa1.paper_block_sizes(0, 8), ValueError, r"sram_bytes")
err("fa1.paper_block_sizes-sram-neg", lambda: fa1.paper_block_sizes(-5, 8), ValueError, r"sram_bytes")
err("fa1.paper_block_sizes-sram-str", lambda: fa1.paper_block_sizes("4096", 8), TypeError, r"sram_bytes")
err("fa1.paper_block_sizes-sram-float", lambda: fa1.paper_block_sizes(4096.5, 8), TypeError, r"sram_bytes")
err("fa1.paper_block_sizes-d-float", lambda: fa1.paper_block_sizes(4096, 8.0), TypeError, r"\bd must be")
ok("fa1.paper_block_sizes-100KB-d64", lambda: fa1.paper_block_sizes(100 * 1024, 64),
   lambda got: got == (64, 200) or pytest.fail(f"got {got}"))

err("decoding.split_bounds-splits-0", lambda: decoding.split_bounds(10, 0), ValueError,
    r"num_splits must be an int >= 1")
err("decoding.split_bounds-splits-neg", lambda: decoding.split_bounds(10, -2), ValueError, r"num_splits")
err("decoding.split_bounds-nk-neg", lambda: decoding.split_bounds(-5, 2), ValueError, r"\bnk must be")
err("decoding.split_bounds-splits-float", lambda: decoding.split_bounds(10, 2.5), TypeError, r"num_splits")
err("decoding.split_bounds-splits-bool", lambda: decoding.split_bounds(10, True), TypeError, r"num_splits")
err("decoding.split_bounds-nk-str", lambda: decoding.split_bounds("10", 2), TypeError, r"\bnk must be")
err("decoding.split_bounds-nk-float", lambda: decoding.split_bounds(10.0, 2), TypeError, r"\bnk must be")
ok("decoding.split_bounds-nk-0", lambda: decoding.split_bounds(0, 3),
   lambda got: got == [(0, 0)] * 3 or pytest.fail(f"got {got}"))
ok("decoding.split_bounds-more-splits-than-keys", lambda: decoding.split_bounds(3, 5),
   lambda got: (len(got) == 5 and got[0][0] == 0 and got[-1][1] == 3
                and all(a[1] == b[0] for a, b in zip(got, got[1:]))) or pytest.fail(f"got {got}"))
ok("decoding.split_bounds-np.int64", lambda: decoding.split_bounds(np.int64(10), np.int64(3)),
   lambda got: got == [(0, 3), (3, 6), (6, 10)] or pytest.fail(f"got {got}"))
for value, exc in ((0, ValueError), (None, TypeError), (2.0, TypeError), (True, TypeError), ("3", TypeError)):
    err(f"decoding.forward-num_splits-{value!r}", lambda x=value: decoding.forward(*nqkv(), num_splits=x),
        exc, r"num_splits must be an int >= 1")
ok("decoding.forward-num_splits-1e9", lambda: decoding.forward(*nqkv(), num_splits=10**9),
   np_close_to(lambda: flashlib.testing.reference(*nqkv())))
ok("decoding.forward-num_splits-np.int64", lambda: decoding.forward(*nqkv(), num_splits=np.int64(2)),
   np_close_to(lambda: flashlib.testing.reference(*nqkv())))
err("decoding.combine-int", lambda: decoding.combine(np.ones((2, 3, 4), int), A(2, 3)), TypeError,
    r"o_parts must be floating-point")
err("decoding.combine-shapes", lambda: decoding.combine(A(2, 3, 4), A(2, 4)), ValueError, r"o_parts must be")
err("decoding.combine-S0", lambda: decoding.combine(A(0, 3, 4), A(0, 3)), ValueError, r"S >= 1")
err("decoding.combine-io", lambda: decoding.combine(A(2, 3, 4), A(2, 3), io=1), TypeError, r"io must be")
for name, args in (("batch_heads", (0, 1, 10, 4)), ("n_query_blocks", (1, -1, 10, 4)),
                   ("nk", (1, 1, 0, 4)), ("num_sms", (1, 1, 10, 0))):
    err(f"decoding.choose_num_splits-{name}", lambda a=args: decoding.choose_num_splits(*a), ValueError,
        rf"{name} must be a positive int")
err("decoding.choose_num_splits-bool", lambda: decoding.choose_num_splits(1, 1, 10, True), TypeError,
    r"num_sms must be")
err("decoding.choose_num_splits-float", lambda: decoding.choose_num_splits(1, 1, 10.0, 4), TypeError,
    r"nk must be")

err("softmax.merge-shapes", lambda: softmax.merge(A(3), A(3), A(4), A(4)), ValueError,
    r"\b(m_a|l_a|m_b|l_b)\b")
err("softmax.merge-m-l-shapes", lambda: softmax.merge(A(3), A(2), A(3), A(3)), ValueError,
    r"\b(m_a|l_a)\b")
err("softmax.merge-str", lambda: softmax.merge("a", A(3), A(3), A(3)), TypeError, r"\bm_a\b")
ok("softmax.merge-identity", lambda: softmax.merge(np.array([-np.inf]), np.array([0.0]), np.array([1.5]),
                                                   np.array([2.0])),
   lambda got: (got[0][0] == 1.5 and got[1][0] == 2.0) or pytest.fail(f"got {got}"))
ok("softmax.merge-scalars", lambda: softmax.merge(0.0, 1.0, 0.0, 1.0),
   lambda got: np.allclose(got[1], 2.0) or pytest.fail(f"got {got}"))
for fn_name in ("naive_softmax", "safe_softmax", "online_softmax", "online_state", "logsumexp"):
    fn = getattr(softmax, fn_name)
    err(f"softmax.{fn_name}-int", lambda f=fn: f(np.arange(4)), TypeError, r"\bx must be .*float")
    err(f"softmax.{fn_name}-empty", lambda f=fn: f(np.zeros((2, 0))), ValueError,
        r"\bx must have a non-empty")
    err(f"softmax.{fn_name}-scalar", lambda f=fn: f(np.float64(1.0)), ValueError, r"\bx must have")
    err(f"softmax.{fn_name}-str", lambda f=fn: f("abc"), TypeError, r"\bx must be")
ok("softmax.safe_softmax-list", lambda: softmax.safe_softmax([1.0, 2.0, 3.0]),
   lambda got: np.allclose(got.sum(), 1.0) or pytest.fail(f"got {got}"))
ok("softmax.safe_softmax-all-neg-inf", lambda: softmax.safe_softmax(np.full(3, -np.inf)),
   lambda got: np.array_equal(got, np.zeros(3)) or pytest.fail(f"got {got}"))
ok("softmax.safe_softmax-nan", lambda: softmax.safe_softmax(np.array([0.0, np.nan, 1.0])),
   lambda got: np.isnan(got).all() or pytest.fail(f"a NaN entry must make the row NaN, got {got}"))
err("softmax.logsumexp-axis", lambda: softmax.logsumexp(A(2, 3), axis=5), ValueError, r"axis")

err("IOCounter-bpe-0", lambda: IOCounter(bytes_per_element=0), ValueError, r"bytes_per_element must be")
err("IOCounter-bpe-str", lambda: IOCounter(bytes_per_element="2"), TypeError, r"bytes_per_element must be")
err("IOCounter-sram-neg", lambda: IOCounter(sram_bytes=-1), ValueError, r"sram_bytes must be")
err("IOCounter-sram-float", lambda: IOCounter(sram_bytes=1.5e3), TypeError, r"sram_bytes must be")

# NaN on the ladder: the same rule
ok("fa2.forward-nan-q-row", lambda: fa2.forward(with_nan(A(1, 4, 4), (0, 2, 1)), A(1, 6, 4), A(1, 6, 4),
                                                block_q=2, block_k=3),
   lambda got: (np.isnan(got[0][0, 2]).all() and np.isnan(got[1][0, 2]) and np.isfinite(got[0][0, :2]).all())
   or pytest.fail(f"o {got[0]}, lse {got[1]}"))
ok("decoding.forward-nan-k", lambda: decoding.forward(A(1, 2, 4), with_nan(A(1, 9, 4), (0, 4, 0)), A(1, 9, 4),
                                                      num_splits=3),
   lambda got: np.isnan(got[0]).all() and np.isnan(got[1]).all() or pytest.fail(f"got {got}"))
ok("fa2.forward-nan-v-behind-mask",
   lambda: (fa2.forward(A(1, 4, 4), A(1, 4, 4), with_nan(A(1, 4, 4), (0, 3)), causal=True, block_q=2,
                        block_k=2)[0][0, :3],
            fa2.forward(A(1, 4, 4), A(1, 4, 4), A(1, 4, 4), causal=True, block_q=2, block_k=2)[0][0, :3]),
   lambda got: np.testing.assert_array_equal(*got))

# =============================================================================== flashlib.auto


def _sd(*shapes, dtype=torch.float32, device="cpu", grad=False):
    return [T(*s, dtype=dtype, device=device, seed=i).requires_grad_(grad) for i, s in enumerate(shapes)]


S4 = ((1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8))
sdpa("auto-scale-True", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale=True))
sdpa("auto-scale-False", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale=False))
sdpa("auto-scale-str", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale="0.5"))
sdpa("auto-scale-nan", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale=math.nan))
sdpa("auto-scale-inf", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale=math.inf))
sdpa("auto-scale-zero", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale=0.0))
sdpa("auto-scale-negative", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale=-0.5))
sdpa("auto-scale-np.float32", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale=np.float32(0.5)))
sdpa("auto-scale-tensor", lambda: F.scaled_dot_product_attention(*_sd(*S4), scale=torch.tensor(0.5)))
sdpa("auto-is_causal-yes", lambda: F.scaled_dot_product_attention(*_sd(*S4), is_causal="yes"))
sdpa("auto-is_causal-1", lambda: F.scaled_dot_product_attention(*_sd(*S4), is_causal=1))
sdpa("auto-is_causal-None", lambda: F.scaled_dot_product_attention(*_sd(*S4), is_causal=None))
sdpa("auto-is_causal-np.bool_", lambda: F.scaled_dot_product_attention(*_sd(*S4), is_causal=np.bool_(True)))
sdpa("auto-enable_gqa-str", lambda: F.scaled_dot_product_attention(
    *_sd((1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)), enable_gqa="yes"))
sdpa("auto-enable_gqa-1", lambda: F.scaled_dot_product_attention(
    *_sd((1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)), enable_gqa=1))
sdpa("auto-dropout-str", lambda: F.scaled_dot_product_attention(*_sd(*S4), dropout_p="0"))
sdpa("auto-dropout-negative", lambda: F.scaled_dot_product_attention(*_sd(*S4), dropout_p=-0.0))
sdpa("auto-gqa-without-flag", lambda: F.scaled_dot_product_attention(*_sd((1, 4, 6, 8), (1, 2, 6, 8),
                                                                          (1, 2, 6, 8))))
sdpa("auto-gqa-3-over-2", lambda: F.scaled_dot_product_attention(
    *_sd((1, 3, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)), enable_gqa=True))
sdpa("auto-gqa-ok", lambda: F.scaled_dot_product_attention(
    *_sd((1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)), enable_gqa=True))
sdpa("auto-B0", lambda: F.scaled_dot_product_attention(*_sd((0, 2, 6, 8), (0, 2, 6, 8), (0, 2, 6, 8))))
sdpa("auto-3d", lambda: F.scaled_dot_product_attention(*_sd((2, 6, 8), (2, 6, 8), (2, 6, 8))))
sdpa("auto-5d", lambda: F.scaled_dot_product_attention(*_sd((1, 1, 2, 6, 8), (1, 1, 2, 6, 8),
                                                            (1, 1, 2, 6, 8))))
sdpa("auto-d-300", lambda: F.scaled_dot_product_attention(*_sd((1, 1, 3, 300), (1, 1, 3, 300),
                                                               (1, 1, 3, 300))))
sdpa("auto-float64", lambda: F.scaled_dot_product_attention(*_sd(*S4, dtype=torch.float64)))
sdpa("auto-dtype-mix", lambda: F.scaled_dot_product_attention(
    *_sd(*S4[:2]), T(1, 2, 6, 8, dtype=torch.float16)))
sdpa("auto-dv-differs", lambda: F.scaled_dot_product_attention(*_sd((1, 2, 6, 8), (1, 2, 6, 8),
                                                                    (1, 2, 6, 4))))
sdpa("auto-causal-nq<nk", lambda: F.scaled_dot_product_attention(
    *_sd((1, 2, 3, 8), (1, 2, 7, 8), (1, 2, 7, 8)), is_causal=True))
sdpa("auto-causal-nq>nk", lambda: F.scaled_dot_product_attention(
    *_sd((1, 2, 7, 8), (1, 2, 3, 8), (1, 2, 3, 8)), is_causal=True))
sdpa("auto-decode-shaped", lambda: F.scaled_dot_product_attention(*_sd((1, 2, 1, 8), (1, 2, 40, 8),
                                                                       (1, 2, 40, 8))))
sdpa("auto-bool-mask", lambda: F.scaled_dot_product_attention(
    *_sd(*S4), attn_mask=torch.ones(6, 6, dtype=torch.bool).tril()))
sdpa("auto-mask-and-causal", lambda: F.scaled_dot_product_attention(
    *_sd(*S4), attn_mask=torch.ones(6, 6, dtype=torch.bool), is_causal=True))
sdpa("auto-int-query", lambda: F.scaled_dot_product_attention(
    torch.ones(1, 2, 6, 8, dtype=torch.int64), *_sd(*S4[1:])))
sdpa("auto-numpy-query", lambda: F.scaled_dot_product_attention(np.ones((1, 2, 6, 8), np.float32),
                                                                *_sd(*S4[1:])))
sdpa("auto-noncontiguous", lambda: F.scaled_dot_product_attention(
    *(x.transpose(1, 2) for x in _sd((1, 6, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)))))
sdpa("auto-requires-grad", lambda: F.scaled_dot_product_attention(*_sd(*S4, grad=True), is_causal=True))
sdpa("auto-meta", lambda: F.scaled_dot_product_attention(*(x.to("meta") for x in _sd(*S4))))
sdpa("auto-keyword-typo", lambda: F.scaled_dot_product_attention(*_sd(*S4), causal=True))

# ========================================================================= flashlib.parallel.ring


def _ring():
    from flashlib.parallel import ring
    return ring


err("ring.shard-rank-past-world", lambda: _ring().shard(T(1, 2, 8, 4), 5, 2), ValueError, r"\brank\b")
err("ring.shard-rank-negative", lambda: _ring().shard(T(1, 2, 8, 4), -1, 2), ValueError, r"\brank\b")
err("ring.shard-world-0", lambda: _ring().shard(T(1, 2, 8, 4), 0, 0), ValueError, r"\bworld\b")
err("ring.shard-world-negative", lambda: _ring().shard(T(1, 2, 8, 4), 0, -2), ValueError, r"\bworld\b")
err("ring.shard-rank-float", lambda: _ring().shard(T(1, 2, 8, 4), 0.5, 2), TypeError, r"\brank\b")
err("ring.shard-world-str", lambda: _ring().shard(T(1, 2, 8, 4), 0, "2"), TypeError, r"\bworld\b")
err("ring.shard-layout", lambda: _ring().shard(T(1, 2, 8, 4), 0, 2, layout="diagonal"), ValueError,
    r"layout must be one of")
err("ring.shard-numpy", lambda: _ring().shard(np.zeros((1, 2, 8, 4)), 0, 2), TypeError, r"\bx must be")
err("ring.shard-indivisible", lambda: _ring().shard(T(1, 2, 7, 4), 0, 2), ValueError,
    r"sequence length 7 must be divisible by 2")
err("ring.shard-dim", lambda: _ring().shard(T(1, 2, 8, 4), 0, 2, dim=7), (ValueError, IndexError), r"\bdim\b")
err("ring.unshard-empty", lambda: _ring().unshard([]), ValueError, r"\bshards\b")
err("ring.unshard-layout", lambda: _ring().unshard([T(1, 2, 4, 4)], layout="nope"), ValueError,
    r"layout must be one of")
err("ring.chunk_ids-rank", lambda: _ring().chunk_ids(3, 2), ValueError, r"\brank\b")
err("ring.chunk_ids-world", lambda: _ring().chunk_ids(0, 0), ValueError, r"\bworld\b")
err("ring.merge_partials-shapes", lambda: _ring().merge_partials(T(1, 2, 4, 8), T(1, 2, 4), T(1, 2, 5, 8),
                                                                 T(1, 2, 5)),
    ValueError, r"\b(o_a|lse_a|o_b|lse_b)\b")
ok("ring.shard-zigzag-roundtrip", lambda: _ring().unshard([_ring().shard(T(1, 2, 8, 4), r, 2, layout="zigzag")
                                                           for r in range(2)], layout="zigzag"),
   lambda got: torch.equal(got, T(1, 2, 8, 4)) or pytest.fail("shard/unshard is not a round trip"))
err("ring_attention-no-group", lambda: _ring().ring_attention(*qkv(NQ=4, NK=4)), RuntimeError,
    r"initialized process group")
err("ring_attention-causal-str", lambda: _ring().ring_attention(*qkv(NQ=4, NK=4), causal="yes"), TypeError,
    r"causal must be a bool")
err("ring_attention-q-numpy", lambda: _ring().ring_attention(np.zeros((1, 2, 4, 8)), *qkv(NQ=4, NK=4)[1:]),
    TypeError, r"q must be a torch\.Tensor")
err("ring_attention-lengths", lambda: _ring().ring_attention(*qkv(NQ=4, NK=6)), ValueError,
    r"q and k shards must have the same length")
err("ring_attention-scale-inf", lambda: _ring().ring_attention(*qkv(NQ=4, NK=4), scale=math.inf), ValueError,
    r"scale must be finite")
err("ring_attention-group-str", lambda: _ring().ring_attention(*qkv(NQ=4, NK=4), group="world"), TypeError,
    r"\bgroup\b", needs=("group",))
err("ring_attention-group-int", lambda: _ring().ring_attention(*qkv(NQ=4, NK=4), group=0), TypeError,
    r"\bgroup\b", needs=("group",))
err("ring_attention-layout", lambda: _ring().ring_attention(*qkv(NQ=4, NK=4), layout="diag"), ValueError,
    r"layout must be one of", needs=("group",))
err("ring_attention-backend", lambda: _ring().ring_attention(*qkv(NQ=4, NK=4), backend="nope"), ValueError,
    r"backend must be one of", needs=("group",))
ok("ring_attention-one-rank", lambda: _ring().ring_attention(*qkv(NQ=4, NK=4), causal=np.bool_(True),
                                                             backend="reference"),
   close_to(lambda: oracle(*qkv(NQ=4, NK=4), causal=True)), needs=("group",))

# ============================================================================== flashlib.puzzles


def _puzzles():
    from flashlib import puzzles
    return puzzles


def _stub(m_a, l_a, m_b, l_b):
    raise NotImplementedError


err("puzzles.get-int", lambda: _puzzles().get(3), TypeError, r"name must be a puzzle's name")
err("puzzles.get-unknown", lambda: _puzzles().get("nope"), ValueError, r"name must be one of")
err("puzzles.get-list", lambda: _puzzles().get(["merge_states"]), TypeError, r"\bname\b")
err("puzzles.check-name-None", lambda: _puzzles().check(None, _stub), TypeError, r"\bname\b")
err("puzzles.check-fn-int", lambda: _puzzles().check("merge_states", 42), TypeError, r"fn must be a function")
err("puzzles.check-fn-None", lambda: _puzzles().check("merge_states", None), TypeError, r"fn must be")
ok("puzzles.check-stub", lambda: _puzzles().check("merge_states", _stub),
   lambda r: r.status == "not attempted" or pytest.fail(str(r)))
ok("puzzles.check-wrong-arity", lambda: _puzzles().check("merge_states", lambda m_a: m_a),
   lambda r: r.status != "correct" or pytest.fail(str(r)))
ok("puzzles.check-raises", lambda: _puzzles().check("merge_states", lambda *a: 1 / 0),
   lambda r: r.status == "wrong" or pytest.fail(str(r)))
ok("puzzles.check-returns-None", lambda: _puzzles().check("merge_states", lambda *a: None),
   lambda r: r.status == "wrong" or pytest.fail(str(r)))
ok("puzzles.check-solution", lambda: _puzzles().check(
    "merge_states", __import__("flashlib.puzzles.solutions", fromlist=["x"]).merge_states),
   lambda r: r.status == "correct" or pytest.fail(str(r)))

# ============================================================================== flashlib.hardware

err("hardware.get-unknown", lambda: flashlib.hardware.get("RTX 9999"), ValueError, r"name must be one of")
err("hardware.get-list", lambda: flashlib.hardware.get(["T4"]), TypeError, r"\bname\b")
def _rehearse(name):
    with flashlib.hardware.rehearse(name):
        pass


err("hardware.rehearse-unknown", lambda: _rehearse("nope"), ValueError, r"name must be one of")
err("hardware.rehearse-int", lambda: _rehearse(4), TypeError, r"name must be a str")
err("hardware.kernel_dtypes-bad-device", lambda: flashlib.hardware.kernel_dtypes("gpu0"), ValueError,
    r"\bdevice\b")
err("hardware.device_facts-bad-device", lambda: flashlib.hardware.device_facts("cuda:x"), ValueError,
    r"\bdevice\b")
err("hardware.device_facts-int", lambda: flashlib.hardware.device_facts(3.5), TypeError, r"\bdevice\b")
err("hardware.flat_programs-zero", lambda: flashlib.hardware.flat_programs(0, 4), ValueError,
    r"outside CUDA's grid limit")
err("hardware.flat_programs-float", lambda: flashlib.hardware.flat_programs(2.5), TypeError,
    r"counts must be")
ok("hardware.kernel_dtypes-cpu", lambda: flashlib.hardware.kernel_dtypes("cpu"),
   lambda got: got == ("float16", "bfloat16", "float32") or pytest.fail(f"got {got}"))

# ============================================================================== the command line

usage("cli-unknown-command", ("nope",), r"invalid choice: 'nope'")
usage("cli-info-unknown-option", ("info", "--bogus"), r"unrecognized arguments: --bogus")
usage("cli-check-backend-nope", ("check", "--backend", "nope"), r"--backend")
usage("cli-check-backend-empty", ("check", "--backend", ""), r"--backend")
usage("cli-compile-report-arch", ("compile-report", "--arch", "sm_999x"), r"--arch")
usage("cli-compile-report-arch-text", ("compile-report", "--arch", "ampere"), r"--arch")
usage("cli-compile-report-dtype", ("compile-report", "--dtype", "fp64"), r"--dtype")
usage("cli-compile-report-triton", ("compile-report", "--triton", "not-a-version"), r"--triton")
usage("cli-bench-n-negative", ("bench", "--n", "-5"), r"--n")
usage("cli-bench-n-zero", ("bench", "--n", "0"), r"--n")
usage("cli-bench-n-text", ("bench", "--n", "abc"), r"--n")
usage("cli-bench-batch-zero", ("bench", "--batch", "0"), r"--batch")
usage("cli-bench-heads-zero", ("bench", "--heads", "0"), r"--heads")
usage("cli-bench-head-dim-1000", ("bench", "--head-dim", "1000"), r"--head-dim")
usage("cli-bench-head-dim-zero", ("bench", "--head-dim", "0"), r"--head-dim")
usage("cli-bench-heads-3-kv-2", ("bench", "--heads", "3", "--kv-heads", "2"), r"--kv-heads|--heads")
usage("cli-bench-kv-heads-zero", ("bench", "--kv-heads", "0"), r"--kv-heads")
usage("cli-bench-dtype", ("bench", "--dtype", "float64"), r"--dtype")
usage("cli-bench-only", ("bench", "--only", "nope"), r"--only")
usage("cli-check-repo-expect", ("check-repo", "--expect", "not a repo"), r"--expect")
usage("cli-check-repo-expect-no-slash", ("check-repo", "--expect", "owner"), r"--expect")
usage("cli-set-repo-not-a-url", ("set-repo", "not a url"), r"\burl\b|URL")


# ======================================================================================== the test

def _group():
    """A one-rank gloo process group for the ring rows (torch.distributed's file store, no network)."""
    import tempfile

    import torch.distributed as dist
    if not dist.is_initialized():
        path = tempfile.mktemp(prefix="flashlib-robustness-")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    return dist


@pytest.fixture
def needs_met(request):
    """Provide what a row needs; the process group is torn down after the row."""
    case = request.param
    torch_dist = None
    for need in case.needs:
        if need == "g++":
            require_tool("g++")
        elif need == "triton":
            require_module("triton")
        elif need == "group":
            torch_dist = _group()
    yield case
    if torch_dist is not None and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def _outcome(fn):
    try:
        return "returned", fn()
    except Exception as exc:            # noqa: BLE001 - the class of the exception is what we compare
        return "raised", exc


def _same_answer(a, b):
    if isinstance(a, torch.Tensor) and a.device.type == "meta":
        return b.device.type == "meta" and a.shape == b.shape and a.dtype == b.dtype
    return torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-5, equal_nan=True) and a.shape == b.shape


def run_case(case: Case) -> None:
    """Run one row and assert its class of answer (the pytest test, and summary(), call this)."""
    kind = case.expect[0]
    if kind == "error":
        _, exc, pattern = case.expect
        with pytest.raises(exc, match=pattern):
            case.fn()
    elif kind == "ok":
        verdict = case.expect[1](case.fn())         # a checker asserts, or returns a truth value
        assert verdict is None or bool(verdict), f"the checker of {case.id} said no"
    elif kind == "usage":
        code, stderr = case.fn()
        assert "Traceback" not in stderr, f"a traceback instead of a usage error:\n{stderr[-2000:]}"
        assert code == 2, f"exit code {code}, expected 2 (argparse's usage error); stderr:\n{stderr[-1000:]}"
        assert "error:" in stderr and re.search(case.expect[1], stderr), \
            f"stderr must be argparse's message naming {case.expect[1]!r}, got:\n{stderr[-1000:]}"
    elif kind == "sdpa":
        from flashlib import auto
        assert not auto.is_enabled()
        plain = _outcome(case.fn)
        with auto.enabled():
            routed = _outcome(case.fn)
        assert plain[0] == routed[0], f"plain SDPA {plain[0]} {plain[1]!r:.200}, with flashlib.auto " \
                                      f"{routed[0]} {routed[1]!r:.200}"
        if plain[0] == "raised":
            assert type(plain[1]) is type(routed[1]), \
                f"SDPA raised {plain[1]!r:.200}, auto {routed[1]!r:.200}"
        else:
            assert _same_answer(plain[1], routed[1]), "flashlib.auto's answer differs from SDPA's"
    else:
        raise AssertionError(f"unknown class {kind!r}")


@pytest.mark.parametrize("needs_met", CASES, ids=[c.id for c in CASES], indirect=True)
def test_case(needs_met):
    run_case(needs_met)


def test_the_table_is_big_and_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(CASES) >= MIN_CASES, f"{len(CASES)} rows; the suite promises at least {MIN_CASES}"
    assert counts()["clear error"] >= 100


def test_triton_launches_from_threads_are_safe():
    """Ten concurrent calls through Triton's interpreter (or the GPU) all succeed and agree."""
    require_module("triton")
    q, k, v = qkv(NQ=8, NK=8, D=16, device=DEVICE)
    want = flashlib.attention(q, k, v, backend="triton")
    results, errors = [None] * 10, []

    def work(i):
        try:
            results[i] = flashlib.attention(q, k, v, backend="triton") if i % 2 else \
                flashlib.decode(q, k, v, num_splits=2, backend="triton")
        except Exception as exc:        # noqa: BLE001 - collected, then reported
            errors.append(repr(exc)[:300])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r in results:
        assert torch.allclose(r, want, atol=1e-5)


# ======================================================================================= the counts

def counts() -> dict:
    """How many rows, and of which class ("clear error": a TypeError/ValueError/RuntimeError naming the
    argument; "usage": the CLI's exit 2; "sdpa": flashlib.auto equals SDPA; "ok": valid input works)."""
    kinds = [c.expect[0] for c in CASES]
    return {"cases": len(CASES), "clear error": kinds.count("error"), "usage": kinds.count("usage"),
            "sdpa": kinds.count("sdpa"), "ok": kinds.count("ok")}


def summary(run: bool = False) -> dict:
    """Print the table's counts; with ``run=True`` also run every row here and list those that fail
    (rows whose needs are missing are reported as skipped). ``python tests/test_robustness.py`` runs."""
    c = counts()
    print(f"robustness suite: {c['cases']} cases; {c['clear error'] + c['usage']} must get a clear error "
          f"({c['clear error']} TypeError/ValueError naming the argument, {c['usage']} CLI usage errors, "
          f"exit 2); {c['sdpa']} must equal torch SDPA under flashlib.auto; {c['ok']} valid odd inputs "
          f"must work")
    if run:
        failed = []
        warnings.simplefilter("error", RuntimeWarning)      # as pyproject.toml's pytest filterwarnings
        for case in CASES:
            dist = None
            try:
                if "group" in case.needs:
                    dist = _group()
                run_case(case)
            except BaseException as exc:     # noqa: BLE001 - pytest's fail/skip are BaseExceptions
                first = str(exc).splitlines()[0] if str(exc) else ""
                failed.append((case.id, f"{type(exc).__name__}: {first}"))
            finally:
                if dist is not None and dist.is_initialized():
                    dist.destroy_process_group()
        print(f"{len(CASES) - len(failed)} pass, {len(failed)} fail")
        for cid, why in failed:
            print(f"  FAIL {cid}: {why[:160]}")
        c["failed"] = [cid for cid, _ in failed]
    return c


if __name__ == "__main__":
    summary(run="--run" in sys.argv)
