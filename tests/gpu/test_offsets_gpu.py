"""The Triton kernels on tensors of 2^31 elements or more, on a real GPU (issue 20, finding 4).

Before their offsets became 64-bit (flashlib/kernels/triton/kit.py, "Offsets"), ``b * stride_b`` and
``rows * stride_n`` were 32-bit products: past 2^31 elements they wrapped, and a kernel read or wrote
another address (wrong results, or a fault that loses the CUDA context). Here:

* decode on the issue's cache, B = 72, Hkv = 8, Nmax = 32768, d = 128 in float16 (2.4e9 elements, 4.8 GB
  each for K and V): every sequence holds a few keys, the last one all 32768, and sequences 0, 70 and
  71 (which starts 2.38e9 elements in) are checked against a float64 truth;
* decode on a token-major cache ``(1, N, Hkv, d)`` read through its ``(1, Hkv, N, d)`` view, N = 2^21 +
  4096: the row stride is Hkv·d = 1024, so the last rows lie past 2^31 elements;
* attention forward and backward on q, k, v that are slices of one (5, 8, 2^19, 128) tensor: batch 4
  starts at 2^31 elements.

Each compares under FlashAttention's rule (flashlib.testing.assert_fa_rule: at most 2x — 3x for gradients
— the error of a plain same-dtype computation against float64, plus flash-attn's rounding slack). A GPU
with too little free memory skips a case with the reason; under FLASHLIB_REQUIRE_ALL it fails instead.
The compile-level twin, tests/kernels/triton/test_triton_offsets.py, checks the TTIR on a CPU.
"""
from __future__ import annotations

import pytest
import torch

import flashlib
from conftest import require
from flashlib.testing import ROUNDING, assert_fa_rule, plain_torch_attention

DEVICE = torch.device("cuda")
LIMIT = 2 ** 31
GIB = 2 ** 30


def _need(gib: float) -> None:
    free = torch.cuda.mem_get_info(DEVICE)[0]
    require(free >= gib * GIB, f"this case needs {gib:.0f} GiB of free GPU memory; the GPU has "
                               f"{free / GIB:.1f} GiB free")


def _randn_(x, seed: int):
    """Fill ``x`` (any view, in place: no temporary as large as a cache) with seeded normals; return it."""
    return x.normal_(generator=torch.Generator(device=DEVICE).manual_seed(seed))


def _decode_plain(q, k, v, dtype):
    """Decode without a mask, one kv head at a time (no expanded copy of a large cache): q (1, H, Nq, d),
    k, v (1, Hkv, N, d) views; computed in ``dtype`` (float64: the truth; float16: the baseline)."""
    h, hkv = q.shape[1], k.shape[1]
    group, scale = h // hkv, q.shape[-1] ** -0.5
    out = []
    for j in range(hkv):
        qj = q[0, j * group:(j + 1) * group].to(dtype)               # (group, Nq, d)
        kj, vj = k[0, j].to(dtype), v[0, j].to(dtype)                 # (N, d)
        p = torch.softmax((qj @ kj.T) * scale, dim=-1)
        out.append(p @ vj)
        del kj, vj, p
    return torch.cat(out)[None]                                       # (1, H, Nq, d)


def _check_decode(o, q, k, v, name):
    want = _decode_plain(q, k, v, torch.float64)
    base = _decode_plain(q, k, v, torch.float16)
    assert_fa_rule(o, base, want.cpu().numpy(), floor=ROUNDING, name=name)


def test_decode_on_the_issues_cache_of_2_4e9_elements():
    B, HKV, NMAX, D, H = 72, 8, 32768, 128, 32
    _need(2 * B * HKV * NMAX * D * 2 / GIB + 4)
    kc = torch.empty(B, HKV, NMAX, D, device=DEVICE, dtype=torch.float16)
    vc = torch.empty_like(kc)
    assert kc.numel() >= LIMIT and (B - 1) * kc.stride(0) >= LIMIT
    lens = torch.randint(1, 65, (B,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    lens[-1] = NMAX                                     # the last sequence full: its keys end the tensor
    for i, x in enumerate((kc[:, :, :64], vc[:, :, :64], kc[-1], vc[-1])):
        _randn_(x, 1 + i)                               # only the rows decode reads are written
    q = _randn_(torch.empty(B, H, 1, D, device=DEVICE, dtype=torch.float16), 5)
    o = flashlib.decode(q, kc, vc, cache_seqlens=lens.to(DEVICE), backend="triton")
    torch.cuda.synchronize()                            # a fault surfaces here at the latest
    for b in (0, B - 2, B - 1):
        n = int(lens[b])
        _check_decode(o[b:b + 1], q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n], f"o of sequence {b}")


def test_decode_on_a_token_major_cache_whose_rows_pass_2_31_elements():
    N, HKV, D, H = 2 ** 21 + 4096, 8, 128, 32
    _need(2 * N * HKV * D * 2 / GIB + 6)
    k_tm = _randn_(torch.empty(1, N, HKV, D, device=DEVICE, dtype=torch.float16), 6)
    v_tm = _randn_(torch.empty_like(k_tm), 7)
    kc, vc = k_tm.transpose(1, 2), v_tm.transpose(1, 2)              # (1, Hkv, N, d), row stride Hkv·d
    assert (N - 1) * kc.stride(2) >= LIMIT
    q = _randn_(torch.empty(1, H, 1, D, device=DEVICE, dtype=torch.float16), 8)
    o = flashlib.decode(q, kc, vc, backend="triton")
    torch.cuda.synchronize()
    _check_decode(o, q, kc, vc, "o (token-major cache)")


def test_attention_with_a_batch_stride_past_2_31_elements():
    B, H, NBIG, N, D = 5, 8, 2 ** 19, 1024, 128
    _need(B * H * NBIG * D * 2 / GIB + 4)
    big = torch.empty(B, H, NBIG, D, device=DEVICE, dtype=torch.float16)
    assert (B - 1) * big.stride(0) >= LIMIT
    q, k, v = (_randn_(big[:, :, i * N:(i + 1) * N], 10 + i) for i in range(3))   # views: no copy
    do = _randn_(torch.empty(B, H, N, D, device=DEVICE, dtype=torch.float16), 20)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]       # still views of big
    o = flashlib.attention(*leaves, causal=True, backend="triton")
    grads = torch.autograd.grad(o, leaves, do)
    torch.cuda.synchronize()
    for b in (0, B - 1):                                # batch 4 starts at 2^31 elements
        part = slice(b, b + 1)
        sl = [x[part].contiguous() for x in (q, k, v, do)]

        def run(dtype):
            xs = [x.to(dtype).requires_grad_() for x in sl[:3]]
            out = plain_torch_attention(*xs, causal=True)
            return (out.detach(), *torch.autograd.grad(out, xs, sl[3].to(dtype)))
        want, base = run(torch.float64), run(torch.float16)
        for name, got, bb, w, factor in zip(("o", "dq", "dk", "dv"), (o, *grads), base, want, (2, 3, 3, 3)):
            assert_fa_rule(got[part], bb, w.cpu().numpy(), factor=factor, floor=ROUNDING,
                           name=f"{name} (batch {b})")
