"""GPU tier: flashlib/triton's kernels (fa2_fwd_v1, fa2_fwd_v4_tma, fa2_bwd_v2, fa2_bwd_v5_tma, decode, configs) compiled,
on CUDA tensors.

What the interpreter cannot show: the real kernel configs (N ~ 1000, d = 128 reach them; 40 tokens
never do), races between programs running at once, and the compiler's own bugs. A real H100 found a
dK/dV config class that was wrong and non-deterministic while every CPU test passed
(flashlib/kernels/triton/configs.py): these tests would have caught it. Same standards as the CPU suite:
fp32 tightly against the float64 oracle, fp16/bf16 under FlashAttention's rule (2x a plain same-dtype
implementation, 3x for gradients), adversarial shapes. The TMA kernels (tensor descriptors, TMA on sm_90,
which the interpreter only emulates) get the same checks at the head dims they take: the TMA forward
(version 4, fa2_fwd_tma's spec in fa2_fwd_v1.forward) named with kernel=("v4", "v2") with the backward, and
against version 1 on the same inputs; the TMA dK/dV (version 5: fa2_bwd_tma's dK/dV spec in version 2's
backward) named with kernel=("v1", "v5"), bit for bit deterministic, and against version 2's gradients
on the same inputs.
"""
from __future__ import annotations

import pytest
import torch

import flashlib
from flashlib.testing import (assert_attention_right, assert_close, assert_fa_rule, plain_torch_attention,
                              reference_gqa)
from flashlib.backends import triton as triton_backend
from flashlib.hardware import kernel_dtypes
from flashlib.kernels.triton import configs, fa2_bwd_v2, fa2_bwd_v5_tma, fa2_fwd_v1, fa2_fwd_v4_tma, versions
from flashlib.kernels.triton.configs import Config
from triton_cases import TABLE_SPECS, case_id, make_qkv, run_triton  # tests/triton_cases.py, shared with tests/kernels/triton

DEVICE = torch.device("cuda")
# Chosen by capability when collected, never skipped: the dtypes this GPU takes (bfloat16 from sm_80;
# the others are tested to be refused, below), and the TMA kernels where this Triton has tensor
# descriptors (3.4 on; before, FLASHLIB_TRITON_FWD/BWD=v4/v5 is tested to fall back to versions 1 and 2,
# and kernel="v4" to be refused).
DTYPES = [getattr(torch, n) for n in kernel_dtypes(DEVICE)]
HALF_DTYPES = [d for d in DTYPES if d != torch.float32]      # what the TMA kernels take
REFUSED = [d for d in (torch.float16, torch.bfloat16, torch.float32) if d not in DTYPES]
TMA_OK = versions.has_tensor_descriptors()
# Where the plain same-dtype baseline is exact (Nq = Nk = 1: dQ is exactly 0), 2x or 3x its error is 0
# and one rounding in the kernel would fail the rule: allow 1e-5, far under a 16-bit error (~1e-3).
FLOOR = 1e-5


def spy_on_spec(monkeypatch, module, name, keyword, spec):
    """Wrap ``module.name`` (a launcher the backend calls, e.g. fa2_fwd_v1.forward) so that it records the
    shape of q at each call whose ``keyword`` argument is ``spec`` (the TMA spec), and runs as before."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        if kwargs.get(keyword) is spec:
            calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)
    return calls


def check_against_oracle(q, k, v, do, causal, got):
    o, lse, grads = got
    assert_attention_right(q, k, v, do, causal=causal, o=o, lse=lse, grads=grads, floor=FLOOR)


# (B, H, Hkv, Nq, Nk, d, causal): lengths no block divides, Nq != Nk both ways, N = 1, d from 40 to
# 256 (59, 111, 192 among them), GQA and MQA, causal rows that see nothing (Nq > Nk), and sizes that
# reach the real configs (N ~ 1000, d = 128).
CASES = [
    (2, 4, 4, 1, 1, 64, False), (1, 4, 2, 1, 300, 59, True), (2, 6, 2, 257, 1000, 111, True),
    (1, 8, 1, 1000, 257, 128, True), (1, 4, 4, 333, 333, 192, False), (1, 2, 1, 129, 77, 256, True),
    (2, 8, 2, 1000, 1037, 128, True), (1, 4, 4, 1000, 1000, 40, False), (1, 16, 16, 77, 4096, 64, True),
    (3, 6, 3, 1023, 1025, 128, False), (1, 4, 1, 700, 900, 256, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_backward_match_the_oracle(case, dtype):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=sum(shape), device=DEVICE)
    check_against_oracle(q, k, v, do, causal, run_triton(q, k, v, do, causal))


def test_rows_that_see_nothing_are_zero_with_finite_gradients():
    q, k, v, do = make_qkv(1, 4, 2, 1000, 300, 128, torch.float16, seed=3, device=DEVICE)  # rows 0..699: nothing
    o, lse, (dq, dk, dv) = run_triton(q, k, v, do, True)
    hidden = 1000 - 300
    assert torch.all(o[:, :, :hidden] == 0) and torch.all(torch.isneginf(lse[:, :, :hidden]))
    assert torch.isfinite(lse[:, :, hidden:]).all()
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.all(dq[:, :, :hidden] == 0)


# ----------------------------------------------------------------------------- determinism, bit for bit

DET_CASES = [(2, 8, 2, 1000, 1037, 128, True), (2, 8, 8, 1031, 1031, 128, False),
             (1, 8, 2, 999, 1500, 64, False), (1, 4, 4, 1000, 1000, 256, True),
             (1, 4, 1, 1024, 1024, 80, True)]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("case", DET_CASES, ids=case_id)
def test_backward_is_bitwise_deterministic_and_right_at_real_sizes(case, dtype):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=11, device=DEVICE)
    first = run_triton(q, k, v, do, causal)
    for _ in range(2):
        again = run_triton(q, k, v, do, causal)
        for name, a, b in zip(("dq", "dk", "dv"), first[2], again[2]):
            assert torch.equal(a, b), f"{name} differs between identical backward calls"
    check_against_oracle(q, k, v, do, causal, first)


@pytest.mark.parametrize("kernel", ["bwd_dkdv", "bwd_dq"] + (["bwd_dkdv_tma"] if TMA_OK else []))
def test_every_backward_candidate_of_this_gpu_is_right_and_deterministic(kernel):
    """Not only the first choice: every config the table may fall back to, forced one at a time (the
    TMA dK/dV, fa2_bwd_v5_tma, reads the dK/dV table too)."""
    arch = configs.device_arch(DEVICE)
    q, k, v, do = make_qkv(2, 8, 2, 1000, 1037, 128, torch.float16, seed=5, device=DEVICE)
    o, lse = fa2_fwd_v1.forward(q, k, v, causal=True, scale=128 ** -0.5)
    o_ref, _, g_ref = reference_gqa(q, k, v, causal=True, do=do)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    base = torch.autograd.grad(plain_torch_attention(*leaves, causal=True), leaves, do)
    tma = kernel == "bwd_dkdv_tma"
    spec, backward = (fa2_bwd_v5_tma.DKDV_SPEC, fa2_bwd_v5_tma.backward) if tma else (TABLE_SPECS[kernel], fa2_bwd_v2.backward)
    tried = 0
    for cfg in configs.arch_candidates(spec, arch, 128, 2):
        kw = {"config_dq" if kernel == "bwd_dq" else "config_dkdv": cfg}
        try:
            g1 = backward(q, k, v, o, lse, do, causal=True, scale=128 ** -0.5, **kw)
        except Exception as e:           # too big for this GPU: KernelSpec.launch would try the next
            if type(e).__name__ == "OutOfResources":
                continue
            raise
        g2 = backward(q, k, v, o, lse, do, causal=True, scale=128 ** -0.5, **kw)
        tried += 1
        for name, a, b, bg, r in zip(("dq", "dk", "dv"), g1, g2, base, g_ref):
            assert torch.equal(a, b), f"{kernel} {cfg}: {name} not deterministic"
            assert_fa_rule(a, bg, r, factor=3.0, name=f"{kernel} {cfg} {name}")
    assert tried > 0


@pytest.mark.parametrize("backward", [fa2_bwd_v2.backward] + ([fa2_bwd_v5_tma.backward] if TMA_OK else []),
                         ids=["version2", "tma_dkdv"][:1 + TMA_OK])
def test_a_config_of_the_class_shown_wrong_is_run_safely(backward):
    """A caller asking for the bad class (flashlib.attention's block_q/block_k) gets its safe twin."""
    q, k, v, do = make_qkv(2, 8, 2, 1000, 1037, 128, torch.float16, seed=6, device=DEVICE)
    o, lse = fa2_fwd_v1.forward(q, k, v, causal=False, scale=128 ** -0.5)
    bad = Config(16, 64, 4, 2)
    assert configs.hazard("bwd_dkdv", bad)
    grads = [backward(q, k, v, o, lse, do, causal=False, scale=128 ** -0.5, config_dkdv=bad)
             for _ in range(3)]
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))


# ------------------------------------------------------------ the TMA forward (tensor descriptors)

# CASES' kinds of shape at head dims the TMA kernels take (multiples of 8: 16-byte TMA strides): N = 1, Nq !=
# Nk both ways with lengths no block divides, GQA and MQA, causal rows that see nothing (Nq > Nk), d from
# 40 to 256 (80 and 192: BLOCK_D wider than d, the columns a descriptor zero-fills), and the sizes that
# reach the real configs (N ~ 1000, d = 128).
TMA_CASES = [
    (2, 4, 4, 1, 1, 64, False), (1, 4, 2, 1, 300, 40, True), (2, 6, 2, 257, 1000, 80, True),
    (1, 8, 1, 1000, 257, 128, True), (1, 4, 4, 333, 333, 192, False), (1, 2, 1, 129, 77, 256, True),
    (2, 8, 2, 1000, 1037, 128, True), (1, 4, 4, 1000, 1000, 40, False), (1, 16, 16, 77, 4096, 64, True),
    (3, 6, 3, 1023, 1025, 128, False), (1, 4, 1, 700, 900, 256, False), (1, 4, 2, 1000, 300, 128, True),
]


def tma_forward(q, k, v, causal, **kw):
    """The TMA forward called directly (never version 1 in its place: it refuses what it cannot take)."""
    assert fa2_fwd_v4_tma.supported(q, k, v) is None
    return fa2_fwd_v4_tma.forward(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5, **kw)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("case", TMA_CASES, ids=case_id)
def test_tma_forward_matches_the_oracle_and_version_1(case, dtype):
    """Under FlashAttention's rule against the float64 oracle, and against version 1 on the same inputs:
    the TMA forward's error at most 2x version 1's (the same algorithm; only the way tiles move changed)."""
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=sum(shape) + 1, device=DEVICE)
    o, lse = tma_forward(q, k, v, causal)
    assert_attention_right(q, k, v, do, causal=causal, o=o, lse=lse, floor=FLOOR)
    o1, lse1 = fa2_fwd_v1.forward(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5)
    o_ref, _ = reference_gqa(q, k, v, causal=causal)
    assert_fa_rule(o, o1, o_ref, factor=2.0, floor=FLOOR, name="o (the TMA forward against version 1)")
    assert_close(lse, lse1, atol=1e-3, rtol=1e-3, name="lse (the TMA forward against version 1)")


def test_tma_forward_rows_that_see_nothing_are_zero():
    q, k, v, _ = make_qkv(1, 4, 2, 1000, 300, 128, torch.float16, seed=13, device=DEVICE)
    o, lse = tma_forward(q, k, v, True)
    hidden = 1000 - 300
    assert torch.all(o[:, :, :hidden] == 0) and torch.all(torch.isneginf(lse[:, :, :hidden]))
    assert torch.isfinite(lse[:, :, hidden:]).all() and torch.isfinite(o).all()


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda t: str(t)[6:])
def test_every_forward_candidate_of_this_gpu_runs_the_tma_forward_right(dtype):
    """Not only the first choice: every forward config the table may fall back to, forced one at a time
    (each is a different pair of TMA block shapes)."""
    arch = configs.device_arch(DEVICE)
    q, k, v, do = make_qkv(2, 8, 2, 1000, 1037, 128, dtype, seed=14, device=DEVICE)
    o_ref, lse_ref = reference_gqa(q, k, v, causal=True)
    base = plain_torch_attention(q, k, v, causal=True)
    tried = 0
    for cfg in configs.arch_candidates(fa2_fwd_v4_tma.SPEC, arch, 128, 2):
        try:
            o, lse = tma_forward(q, k, v, True, config=cfg)
        except Exception as e:           # too big for this GPU: KernelSpec.launch would try the next
            if type(e).__name__ == "OutOfResources":
                continue
            raise
        tried += 1
        assert_fa_rule(o, base, o_ref, factor=2.0, name=f"fa2_fwd_tma {cfg} o")
        assert_close(lse, lse_ref, atol=2e-2, rtol=2e-2, name=f"fa2_fwd_tma {cfg} lse")
    assert tried > 0


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("case", [(2, 8, 2, 1000, 1037, 128, True), (1, 8, 8, 1031, 1031, 128, False)],
                         ids=case_id)
def test_backward_after_the_tma_forward_is_right_and_bitwise_deterministic(case, dtype, monkeypatch):
    """flashlib.attention with kernel=("v4", "v2"): the TMA forward (fa2_fwd_v1.forward with
    fa2_fwd_v4_tma.SPEC; a spy counts its calls) saves the o and lse version 2's backward reads; gradients
    right and equal bit for bit."""
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=15, device=DEVICE)
    assert fa2_fwd_v4_tma.supported(q, k, v, do) is None
    calls = spy_on_spec(monkeypatch, fa2_fwd_v1, "forward", "spec", fa2_fwd_v4_tma.SPEC)
    first = run_triton(q, k, v, do, causal, kernel=("v4", "v2"))
    again = run_triton(q, k, v, do, causal, kernel=("v4", "v2"))
    assert calls == [tuple(q.shape)] * 2, "kernel='v4' did not run the TMA forward"
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    for name, a, b in zip(("dq", "dk", "dv"), first[2], again[2]):
        assert torch.equal(a, b), f"{name} differs between identical backward calls"
    check_against_oracle(q, k, v, do, causal, first)


# B·H beyond CUDA's 65,535 on a second grid axis (the TMA forward's grid is flat, like version 1's): 100,000
# sequences of one head, and B = 1024 x H = 128 with GQA (each program also writes its four descriptors
# to Triton's scratch, which KernelSpec.launch supplies: 512 bytes a program). Every output is checked,
# a slice of B·H at a time.
@pytest.mark.parametrize("B,H,HKV", [(100_000, 1, 1), (1024, 128, 8)], ids=["B100000", "B1024xH128-gqa"])
def test_tma_forward_beyond_65535_batch_heads(B, H, HKV):
    n, d = 16, 64
    q, k, v, do = make_qkv(B, H, HKV, n, n, d, torch.float16, seed=16, device=DEVICE)
    o, lse = tma_forward(q, k, v, True)
    torch.cuda.synchronize()                   # a launch error surfaces here at the latest
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()      # every program ran (causal, Nq = Nk)
    base = plain_torch_attention(q, k, v, causal=True)
    step = max(1, 16384 // H)                  # batch entries per float64 slice
    for s in range(0, B, step):
        part = slice(s, s + step)
        want = plain_torch_attention(*(x[part].double() for x in (q, k, v)), causal=True)
        assert_fa_rule(o[part], base[part], want, name=f"o (batch {s}..{min(s + step, B) - 1})")
    # o and lse against the float64 oracle itself on the last batch entry (the last programs launched)
    last = [x[-1:] for x in (q, k, v, do)]
    assert_attention_right(*last, causal=True, o=o[-1:], lse=lse[-1:], floor=FLOOR)


# ------------------------------------------------------------------ the TMA dK/dV (tensor descriptors)

TMA_DKDV = ("v1", "v5")      # kernel=: version 1's forward, version 2's backward with the TMA dK/dV


@pytest.fixture
def tma_dkdv(monkeypatch):
    """A spy that records the shape of q at each fa2_bwd_v2.backward call with the TMA dK/dV
    (dkdv_spec=fa2_bwd_v5_tma.DKDV_SPEC): the tests run flashlib.attention with kernel=TMA_DKDV."""
    return spy_on_spec(monkeypatch, fa2_bwd_v2, "backward", "dkdv_spec", fa2_bwd_v5_tma.DKDV_SPEC)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("case", TMA_CASES, ids=case_id)
def test_tma_dkdv_gradients_match_the_oracle(case, dtype, tma_dkdv):
    """Gradients under FlashAttention's rule (3x the plain same-dtype implementation's error) at the TMA
    forward's shapes: N = 1, lengths no block divides, GQA/MQA (dK/dV summed over a group in the kernel),
    causal rows that see nothing, d from 40 to 256, and the real configs (N ~ 1000, d = 128)."""
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=sum(shape) + 2, device=DEVICE)
    assert fa2_fwd_v4_tma.supported(q, k, v, do) is None
    got = run_triton(q, k, v, do, causal, kernel=TMA_DKDV)
    assert tma_dkdv == [tuple(q.shape)], "kernel=('v1', 'v5') did not run the TMA dK/dV"
    check_against_oracle(q, k, v, do, causal, got)


TMA_DKDV_DET_CASES = [(2, 8, 2, 1000, 1037, 128, True), (2, 8, 2, 1031, 1031, 128, False),
                      (1, 8, 8, 1000, 1000, 128, True), (1, 4, 4, 999, 1500, 128, False)]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("case", TMA_DKDV_DET_CASES, ids=case_id)
def test_tma_dkdv_is_bitwise_deterministic_and_right_against_version_2(case, dtype, tma_dkdv):
    """Two identical backward calls through the TMA dK/dV give the same gradients bit for bit, within
    FlashAttention's rule of the float64 oracle; on the same inputs (the o and lse flashlib.attention
    saved) its dK and dV err at most 3x as much as version 2's, and dQ, which version 2's dQ kernel
    computes in both, is version 2's bit for bit."""
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=17, device=DEVICE)
    first = run_triton(q, k, v, do, causal, kernel=TMA_DKDV)
    again = run_triton(q, k, v, do, causal, kernel=TMA_DKDV)
    assert len(tma_dkdv) == 2, "kernel=('v1', 'v5') did not run the TMA dK/dV"
    for name, a, b in zip(("dq", "dk", "dv"), first[2], again[2]):
        assert torch.equal(a, b), f"{name} differs between identical backward calls (the TMA dK/dV)"
    check_against_oracle(q, k, v, do, causal, first)
    o, lse, grads = first
    v2 = fa2_bwd_v2.backward(q, k, v, o, lse, do, causal=causal, scale=q.shape[-1] ** -0.5)
    _, _, g_ref = reference_gqa(q, k, v, causal=causal, do=do)
    for name, a, b, r in zip(("dq", "dk", "dv"), grads, v2, g_ref):
        assert_fa_rule(a, b, r, factor=3.0, floor=FLOOR, name=f"{name} (the TMA dK/dV against version 2)")
    assert torch.equal(grads[0], v2[0]), "dq: the same dQ kernel on the same inputs differs from version 2's"


# B·H beyond CUDA's 65,535 programs on a second grid axis: the dK/dV grid is one program per key block
# of each (batch, kv head), flat like version 2's, so B·Hkv must pass 65,535 (100,000 sequences of one
# head; B = 1024 x H = Hkv = 128). Each program writes its descriptors to Triton's scratch. Every
# gradient is checked, a slice of the batch at a time against a float64 truth (memory stays small at n = 16).
@pytest.mark.parametrize("B,H,HKV", [(100_000, 1, 1), (1024, 128, 128)], ids=["B100000", "B1024xH128"])
def test_tma_dkdv_beyond_65535_batch_heads(B, H, HKV, tma_dkdv):
    n, d = 16, 64

    def attention_and_grads(fn, q, k, v, do):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = fn(*leaves)
        return (o.detach(), *torch.autograd.grad(o, leaves, do))
    q, k, v, do = make_qkv(B, H, HKV, n, n, d, torch.float16, seed=18, device=DEVICE)
    o, lse, grads = run_triton(q, k, v, do, True, kernel=TMA_DKDV)
    torch.cuda.synchronize()                   # a launch error surfaces here at the latest
    assert tma_dkdv == [tuple(q.shape)], "kernel=('v1', 'v5') did not run the TMA dK/dV"
    assert all(torch.isfinite(g).all() for g in grads)
    base = attention_and_grads(lambda *x: plain_torch_attention(*x, causal=True), q, k, v, do)
    step = max(1, 16384 // H)                  # batch entries per float64 slice
    for s in range(0, B, step):
        part = slice(s, s + step)
        want = attention_and_grads(lambda *x: plain_torch_attention(*x, causal=True),
                                   *(x[part].double() for x in (q, k, v, do)))
        for name, a, b, w in zip(("dq", "dk", "dv"), grads, base[1:], want[1:]):
            assert_fa_rule(a[part], b[part], w, factor=3.0, name=f"{name} (batch {s}..{min(s + step, B) - 1})")
    # every gradient against the float64 oracle itself on the last batch entry (the last programs launched)
    last = [x[-1:] for x in (q, k, v, do)]
    assert_attention_right(*last, causal=True, o=o[-1:], lse=lse[-1:], grads=[g[-1:] for g in grads], floor=FLOOR)


# ----------------------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_ragged_decode_lengths_zero_one_and_long(dtype, num_splits):
    lens = [0, 1, 20011, 777]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(4, 8, 1, 128, generator=g).to(DEVICE, dtype)
    kc, vc = (torch.randn(4, 2, 20011, 128, generator=g).to(DEVICE, dtype) for _ in range(2))
    seqlens = torch.tensor(lens, device=DEVICE, dtype=torch.int32)
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=seqlens, return_lse=True, num_splits=num_splits,
                             backend="triton")
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.all(o[b] == 0) and torch.all(torch.isneginf(lse[b]))
            continue
        o_ref, lse_ref = reference_gqa(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n])
        if dtype == torch.float32:
            assert_close(o[b:b + 1].cpu().double(), o_ref, atol=2e-5, rtol=2e-5, name=f"o[{b}]")
        else:
            base = plain_torch_attention(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n])
            assert_fa_rule(o[b:b + 1], base, o_ref, name=f"o[{b}] (len {n})")
        assert_close(lse[b:b + 1].cpu().double(), lse_ref, atol=1e-3, rtol=1e-3, name=f"lse[{b}]")


# ------------------------------------------------------------------------------------ torch.compile

def test_torch_compile_sees_one_op_and_matches_eager():
    q, k, v, do = make_qkv(2, 8, 2, 300, 517, 64, torch.float16, seed=8, device=DEVICE)

    def f(q, k, v):
        return flashlib.attention(q, k, v, causal=True, backend="triton")

    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(f, fullgraph=True)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = compiled(*leaves)
    grads = torch.autograd.grad(out, leaves, do)
    eager = run_triton(q, k, v, do, True)
    assert torch.equal(out.detach(), eager[0])
    for a, b in zip(grads, eager[2]):
        assert torch.equal(a, b)


# ------------------------------------------- what this GPU or this Triton cannot run: tested as refused
if REFUSED:
    @pytest.mark.parametrize("dtype", REFUSED, ids=lambda t: str(t)[6:])
    def test_dtypes_this_gpu_lacks_are_refused_with_the_documented_error(dtype):
        """bfloat16 below sm_80 (flashlib.hardware.kernel_dtypes leaves it out): the ValueError of
        configs.check_dtype_arch, raised before any kernel compiles."""
        q, k, v, _ = make_qkv(1, 2, 1, 33, 40, 64, dtype, seed=9, device=DEVICE)
        why = "bfloat16 needs compute capability 8.0 \\(sm_80\\) or newer"
        with pytest.raises(ValueError, match=why):
            flashlib.attention(q, k, v, causal=True, backend="triton")
        with pytest.raises(ValueError, match=why):
            flashlib.decode(q[:, :, :1], k, v, backend="triton")

if not TMA_OK:
    del (test_tma_forward_matches_the_oracle_and_version_1, test_tma_forward_rows_that_see_nothing_are_zero,
         test_every_forward_candidate_of_this_gpu_runs_the_tma_forward_right,
         test_backward_after_the_tma_forward_is_right_and_bitwise_deterministic,
         test_tma_forward_beyond_65535_batch_heads, test_tma_dkdv_gradients_match_the_oracle,
         test_tma_dkdv_is_bitwise_deterministic_and_right_against_version_2, test_tma_dkdv_beyond_65535_batch_heads)

    def test_asking_for_the_tma_kernels_on_a_triton_without_descriptors_runs_versions_1_and_2(monkeypatch):
        """Triton before 3.4 has no tl.make_tensor_descriptor: the defaults FLASHLIB_TRITON_FWD=v4 and
        FLASHLIB_TRITON_BWD=v5 fall back to versions 1 and 2; kernel="v4" named is a ValueError."""
        monkeypatch.setenv("FLASHLIB_TRITON_FWD", "v4")
        monkeypatch.setenv("FLASHLIB_TRITON_BWD", "v5")
        q, k, v, do = make_qkv(1, 4, 2, 300, 333, 64, torch.float16, seed=10, device=DEVICE)
        assert triton_backend.forward_version(q, k, v) == "v1"
        assert triton_backend.backward_version(q, k, v, do) == "v2"
        assert fa2_fwd_v4_tma.supported(q, k, v) is not None
        check_against_oracle(q, k, v, do, True, run_triton(q, k, v, do, True))
        for kernel in ("v4", ("v1", "v5")):
            with pytest.raises(ValueError, match="cannot run these inputs: triton"):
                run_triton(q, k, v, do, True, kernel=kernel)
