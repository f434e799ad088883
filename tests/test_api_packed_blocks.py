"""attention_qkvpacked and user-chosen block_q / block_k."""
import pytest
import torch

import flashlib
from conftest import DEVICE
from flashlib.testing import assert_close, reference_gqa


def _qkv(b=2, n=37, h=3, d=40, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, 3, h, d, generator=g, dtype=dtype).to(device).requires_grad_()


def _device(backend):
    """Triton's tensors go to DEVICE (compiled on a GPU, interpreted on a CPU); the reference's stay."""
    return DEVICE if backend == "triton" else "cpu"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_packed_equals_unpacked_with_gradients(backend):
    qkv = _qkv(device=_device(backend))
    o = flashlib.attention_qkvpacked(qkv, causal=True, backend=backend)
    assert o.shape == (2, 37, 3, 40)
    do = torch.randn_like(o)
    (g,) = torch.autograd.grad(o, qkv, do)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o_ref, _, (dq, dk, dv) = reference_gqa(q, k, v, causal=True, do=do.transpose(1, 2))
    assert_close(o.transpose(1, 2), o_ref, atol=2e-5, rtol=1e-5)
    for i, want in enumerate((dq, dk, dv)):
        assert_close(g[:, :, i].transpose(1, 2), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend,blocks", [("reference", (5, 7)), ("reference", (1, 64)),
                                            ("triton", (16, 32)), ("triton", (32, 16))])
def test_user_blocks_give_the_same_result(backend, blocks):
    qkv = _qkv(n=45, seed=1, device=_device(backend))
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o = flashlib.attention(q, k, v, causal=True, backend=backend, block_q=blocks[0],
                           block_k=blocks[1])
    grads = torch.autograd.grad(o.square().sum(), (q, k, v))
    o_ref, _, g_ref = reference_gqa(q, k, v, causal=True, do=2 * o.detach())
    assert_close(o.detach(), o_ref, atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, g_ref):
        assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_block_io_counts_follow_the_users_blocks():
    # The reference backend really uses the chunking asked for: more query blocks, more K/V reads.
    from flashlib.ladder import fa2
    from flashlib.ladder.iomodel import IOCounter
    few, many = IOCounter(), IOCounter()
    q = torch.randn(1, 1, 64, 16, dtype=torch.float64).numpy()
    fa2.forward(q[0, 0], q[0, 0], q[0, 0], block_q=64, io=few)
    fa2.forward(q[0, 0], q[0, 0], q[0, 0], block_q=8, io=many)
    assert many.hbm_read_bytes > few.hbm_read_bytes


@pytest.mark.parametrize("kw,exc,msg", [
    ({"block_q": 0}, ValueError, "block_q must be a positive int"),
    ({"block_k": 2.0}, TypeError, "block_k must be a positive int"),
    ({"block_q": 24, "backend": "triton"}, ValueError, "power of two >= 16"),
    ({"block_q": 32, "backend": "cuda"}, ValueError, "backend='cuda' sizes its tiles"),
])
def test_bad_blocks(kw, exc, msg):
    q = torch.randn(1, 1, 8, 16, device=_device(kw.get("backend")))
    with pytest.raises(exc, match=msg):
        flashlib.attention(q, q, q, **kw)


def test_bad_packed_input():
    with pytest.raises(ValueError, match=r"qkv must have shape \(B, N, 3, H, d\)"):
        flashlib.attention_qkvpacked(torch.zeros(2, 5, 2, 3, 8))
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        flashlib.attention_qkvpacked([1, 2])
