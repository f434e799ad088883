"""flashlib.ladder._checks: bad input is refused with an error naming the argument, never a crash deep inside NumPy."""
import numpy as np
import pytest

from flashlib.ladder import decoding, fa1, fa2, memeff, naive
from flashlib.testing import random_qkv

Q, K, V = random_qkv(4, 6, 3)
CALLS = {
    "naive": lambda q=Q, k=K, v=V, **kw: naive.attention(q, k, v, **kw),
    "fa1": lambda q=Q, k=K, v=V, **kw: fa1.forward(q, k, v, **kw),
    "fa2": lambda q=Q, k=K, v=V, **kw: fa2.forward(q, k, v, **kw),
    "decoding": lambda q=Q, k=K, v=V, **kw: decoding.forward(q, k, v, num_splits=2, **kw),
    "lse_first": lambda q=Q, k=K, v=V, **kw: memeff.lse_first(q, k, v, **kw),
    "chunked": lambda q=Q, k=K, v=V, **kw: memeff.chunked(q, k, v, **kw),
}
ALL = pytest.mark.parametrize("name", sorted(CALLS))


@ALL
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_rank_below_two(name, arg):
    with pytest.raises(ValueError, match=rf"{arg} must have shape \(\.\.\., N, d\)"):
        CALLS[name](**{arg: np.zeros(3)})


@ALL
@pytest.mark.parametrize("arg", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.int64, np.complex128, np.bool_])
def test_integer_complex_bool_dtypes(name, arg, dtype):
    bad = {"q": Q, "k": K, "v": V}[arg].astype(dtype)
    with pytest.raises(TypeError, match=f"{arg} must have a real floating dtype"):
        CALLS[name](**{arg: bad})


@ALL
def test_mismatched_shapes(name):
    with pytest.raises(ValueError, match="leading dims"):
        CALLS[name](q=Q[None], k=K, v=V)
    with pytest.raises(ValueError, match="k must have the head dim of q"):
        CALLS[name](k=np.zeros((6, 4)))
    with pytest.raises(ValueError, match="v must have as many rows as k"):
        CALLS[name](v=np.zeros((5, 3)))
    with pytest.raises(ValueError, match=r"Nk >= 1"):
        CALLS[name](k=np.zeros((0, 3)), v=np.zeros((0, 3)))
    with pytest.raises(ValueError, match=r"Nq >= 1"):
        CALLS[name](q=np.zeros((0, 3)))


@ALL
def test_bad_scale_and_io(name):
    with pytest.raises(TypeError, match="scale must be a real number"):
        CALLS[name](scale="0.5")
    with pytest.raises(ValueError, match="scale must be finite"):
        CALLS[name](scale=float("nan"))
    with pytest.raises(TypeError, match="io must be a flashlib.ladder.iomodel.IOCounter"):
        CALLS[name](io=object())


def test_torch_tensors_are_pointed_to_the_torch_api():
    import torch
    with pytest.raises(TypeError, match="q must be a NumPy array.*flashlib.attention"):
        fa2.forward(torch.zeros(2, 2), K, V)


@pytest.mark.parametrize("kw,exc,msg", [
    ({"block_q": 0}, ValueError, "block_q must be a positive int"),
    ({"block_k": -3}, ValueError, "block_k must be a positive int"),
    ({"block_q": 2.5}, TypeError, "block_q must be a positive int"),
    ({"block_k": True}, TypeError, "block_k must be a positive int"),
])
@pytest.mark.parametrize("fn", [fa1.forward, fa2.forward])
def test_bad_blocks(fn, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        fn(Q, K, V, **kw)


def test_bad_blocks_backward():
    o, lse = fa2.forward(Q, K, V)
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        fa2.backward(Q, K, V, o, lse, np.ones_like(o), block_k=0)


def test_bad_backward_tensors():
    o, lse = fa2.forward(Q, K, V)
    with pytest.raises(ValueError, match=r"do must have shape \(4, 3\)"):
        fa2.backward(Q, K, V, o, lse, np.ones((3, 3)))
    with pytest.raises(ValueError, match=r"lse must have shape \(4,\)"):
        fa2.backward(Q, K, V, o, lse[:2], np.ones_like(o))
    with pytest.raises(ValueError, match=r"o must have shape \(4, 3\)"):
        naive.backward(Q, K, V, o[:1], np.ones_like(o))


def test_bad_sram_bytes():
    with pytest.raises(ValueError, match="sram_bytes must be a positive int"):
        fa1.forward(Q, K, V, sram_bytes=0)
    with pytest.raises(ValueError, match="sram_bytes=8 is too small for one tile"):
        fa1.forward(Q, K, V, sram_bytes=8)


@pytest.mark.parametrize("splits,exc", [(0, ValueError), (-2, ValueError), (1.0, TypeError),
                                        (None, TypeError)])
def test_bad_num_splits(splits, exc):
    with pytest.raises(exc, match="num_splits must be an int >= 1"):
        decoding.forward(Q, K, V, num_splits=splits)


def test_bad_combine_inputs():
    with pytest.raises(ValueError, match="o_parts must be"):
        decoding.combine(np.zeros((2, 4, 3)), np.zeros((3, 4)))
    with pytest.raises(TypeError, match="lse_parts must be floating-point"):
        decoding.combine(np.zeros((2, 4, 3)), np.zeros((2, 4), dtype=int))


def test_bad_chunks():
    with pytest.raises(ValueError, match="query_chunk must be a positive int"):
        memeff.chunked(Q, K, V, query_chunk=0)
