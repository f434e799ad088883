"""Tests of the ragged (varlen) Triton backward, fa2_bwd_v2.backward_varlen (flashlib/kernels/triton/
fa2_bwd_v2.py, its kernels with VARLEN on), on conftest's DEVICE.

Sequences packed token-major (q, o, do (Tq, H, d); k, v (Tk, Hkv, d); lse (H, Tq)) with cu_seqlens; the
o and lse the backward reads are the float64 oracle's (flashlib.testing.reference_varlen, each sequence
attended alone), so that these tests check the backward alone. Gradients against the same oracle:
float32 within 1e-4, float16 by FlashAttention's rule per sequence (3x a plain same-dtype implementation,
assert_attention_right). Shapes: empty sequences both ways (nq_b = 0, nk_b = 0), length 1, lengths no
block divides, nq != nk both ways, causal rows that see nothing (gradients 0, never NaN), GQA, head dims
40 and 59, small forced blocks (several tiles per sequence), every variant (window, softcap, ALiBi per
sequence, sinks with dsinks, dropout on each sequence's own counters) alone and combined, strided views,
bit-for-bit determinism, bitwise equality with the dense backward where every sequence has the same
lengths, the varlen Triton forward's o and lse fed in (same layouts, same dropout counters), random
ragged batches (hypothesis), and cu_seqlens the kernels must clamp. Last, the VARLEN kernels compile
for sm_75, sm_80 and sm_90 with the installed Triton (the compile report's machinery, cached on disk
by source hash).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, need_module, require_module, require_tool
from test_triton_variants_bwd import ALONE as VARIANTS
from triton_cases import VARIANT_SEED as SEED

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashlib.kernels.triton import fa2_bwd_v2  # noqa: E402
from flashlib.kernels.triton.configs import Config  # noqa: E402
from flashlib.ladder.dropout import keep_mask  # noqa: E402
from flashlib.testing import ROUNDING, assert_attention_right, assert_close, reference_varlen  # noqa: E402

SMALL = Config(16, 16)            # forced small blocks: several tiles per sequence


def cu(lengths):
    """cu_seqlens (B+1,) int32 on DEVICE for ``lengths``."""
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=DEVICE)


def make_batch(lq, lk, H, HKV, d, dtype=torch.float32, seed=0):
    """``q, k, v, do`` token-major, drawn on the CPU from one seeded generator, moved to DEVICE."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((sum(lq), H, d), (sum(lk), HKV, d), (sum(lk), HKV, d), (sum(lq), H, d))
    return [torch.randn(*s, generator=g).to(DEVICE, dtype) for s in shapes]


def make_variants(lq, lk, H, *, window=(-1, -1), softcap=0.0, alibi=False, sinks=False, dropout_p=0.0):
    """``(kernel_kw, oracle_kw)``: the variants as backward_varlen takes them (alibi_slopes float32
    (B, H), sinks (H,), dropout_seed) and as reference_varlen does (dropout: one keep mask per
    sequence, the dense counters of its (1, H, nq_b, nk_b) problem at offset + b·H·max_q·max_k)."""
    g = torch.Generator().manual_seed(1000)
    kern, ref = {}, {}
    if tuple(window) != (-1, -1):
        kern["window_size"] = ref["window_size"] = tuple(window)
    if softcap:
        kern["softcap"] = ref["softcap"] = float(softcap)
    if alibi:
        slopes = torch.rand(len(lq), H, generator=g) * 0.5 + 0.05
        kern["alibi_slopes"], ref["alibi_slopes"] = slopes.to(DEVICE), slopes.numpy()
    if sinks:
        s = torch.randn(H, generator=g)
        kern["sinks"], ref["sinks"] = s.to(DEVICE), s.numpy()
    if dropout_p:
        seed, offset = SEED
        step = H * max(lq) * max(lk)
        kern["dropout_p"] = ref["dropout_p"] = dropout_p
        kern["dropout_seed"] = SEED
        ref["dropout_masks"] = [keep_mask(seed, offset + b * step, (1, H, nq, nk), dropout_p)[0]
                                if nq and nk else np.zeros((H, nq, nk), bool)
                                for b, (nq, nk) in enumerate(zip(lq, lk))]
    return kern, ref


def run(q, k, v, do, lq, lk, causal, kern, ref, *, cfg=None, views=None):
    """backward_varlen on the oracle's o and lse: ``(grads, oracle_grads)``. ``views``: a function
    applied to q, k, v, o, do before the call (strided layouts)."""
    scale = q.shape[-1] ** -0.5
    cq, ck = cu(lq), cu(lk)
    o, lse, want = reference_varlen(q, k, v, cq, ck, causal=causal, scale=scale, do=do, **ref)
    o = torch.from_numpy(o).to(DEVICE, q.dtype)
    lse = torch.from_numpy(lse).to(DEVICE, torch.float32)
    args = (q, k, v, o, do) if views is None else tuple(views(x) for x in (q, k, v, o, do))
    qq, kk, vv, oo, dd = args
    got = fa2_bwd_v2.backward_varlen(qq, kk, vv, oo, lse, dd, cq, ck, max(lq, default=0),
                                     max(lk, default=0), causal=causal, scale=scale, config_dkdv=cfg,
                                     config_dq=cfg, **kern)
    assert len(got) == (4 if "sinks" in kern else 3)
    for g, x in zip(got, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and torch.isfinite(g).all()
    return got, want


def check_fp32(q, k, v, do, lq, lk, causal, *, cfg=SMALL, views=None, **variants):
    """float32 gradients (and dsinks) within 1e-4 of the oracle."""
    kern, ref = make_variants(lq, lk, q.shape[1], **variants)
    got, want = run(q, k, v, do, lq, lk, causal, kern, ref, cfg=cfg, views=views)
    for a, b, name in zip(got, want, ("dq", "dk", "dv", "dsinks")):
        assert_close(a, b, atol=1e-4, rtol=1e-4, name=name)
    return got


# (H, Hkv, d, lengths q, lengths k): empty sequences both ways and at both ends, length 1, GQA; nq > nk
# and nq < nk with lengths no block divides, d = 40; d = 59 with causal rows that see nothing (45 > 17)
CASES = {
    "ragged-empty-gqa": (2, 1, 16, [0, 3, 0, 17, 1, 5, 0], [2, 5, 4, 9, 1, 0, 0]),
    "nq-ne-nk-d40": (4, 2, 40, [19, 33], [37, 21]),
    "unseen-rows-d59": (1, 1, 59, [45, 7], [17, 7]),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_the_oracle_fp32(case, causal):
    H, HKV, d, lq, lk = CASES[case]
    q, k, v, do = make_batch(lq, lk, H, HKV, d)
    check_fp32(q, k, v, do, lq, lk, causal)


def test_default_configs_and_rows_that_see_nothing():
    """The device's own configs; rows that see no key (nk_b = 0, or causal with nq_b > nk_b) get a
    gradient of exactly 0, and keys no query sees (nq_b = 0) exactly 0 too."""
    H, HKV, d, lq, lk = CASES["unseen-rows-d59"]
    lq, lk = lq + [4, 0], lk + [0, 3]
    q, k, v, do = make_batch(lq, lk, H, HKV, d, seed=1)
    dq, dk, dv = check_fp32(q, k, v, do, lq, lk, True, cfg=None)
    assert (dq[:45 - 17] == 0).all()                 # sequence 0's rows that see nothing
    assert (dq[52:56] == 0).all()                     # sequence 2: queries, no key
    assert (dk[24:27] == 0).all() and (dv[24:27] == 0).all()   # sequence 3: keys, no query


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=4),
       d=st.integers(1, 48), causal=st.booleans(), heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
       window=st.sampled_from([(-1, -1), (3, 0), (2, 5)]), seed=st.integers(0, 2**16))
def test_property_random_ragged_batches_match_the_oracle(lengths, d, causal, heads, window, seed):
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    q, k, v, do = make_batch(lq, lk, heads[0], heads[1], d, seed=seed)
    check_fp32(q, k, v, do, lq, lk, causal, window=window)


COMBINED = dict(window=(6, 2), softcap=2.0, alibi=True, sinks=True, dropout_p=0.25)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_alone_fp32(variant):
    H, HKV, d, lq, lk = CASES["ragged-empty-gqa"]
    q, k, v, do = make_batch(lq, lk, H, HKV, d, seed=2)
    got = check_fp32(q, k, v, do, lq, lk, True, **VARIANTS[variant])
    if variant == "sinks":
        assert got[3].shape == (H,) and got[3].dtype == torch.float32


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_all_variants_combined_fp32(causal):
    H, HKV, d, lq, lk = CASES["nq-ne-nk-d40"]
    lq, lk = lq + [0, 6], lk + [3, 0]
    q, k, v, do = make_batch(lq, lk, H, HKV, d, seed=3)
    check_fp32(q, k, v, do, lq, lk, causal, **COMBINED)


@pytest.mark.parametrize("variants", [{}, COMBINED], ids=["plain", "combined"])
def test_half_precision_within_flashattention_rule(variants):
    """float16, per nonempty sequence: 3x the error of a plain float16 implementation, plus rounding
    (dsinks: the oracle's sum within 2e-2)."""
    H, HKV, d, lq, lk = 4, 2, 40, [23, 0, 9, 1], [30, 5, 9, 1]
    q, k, v, do = make_batch(lq, lk, H, HKV, d, torch.float16, seed=4)
    kern, ref = make_variants(lq, lk, H, **variants)
    got, want = run(q, k, v, do, lq, lk, True, kern, ref, cfg=SMALL)
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    for b in range(len(lq)):
        if lq[b] == 0 or lk[b] == 0:
            continue
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        seq = [x.transpose(0, 1)[None] for x in (q[rq], k[rk], v[rk], do[rq])]
        grads = [g.transpose(0, 1)[None] for g in (got[0][rq], got[1][rk], got[2][rk])]
        var = {n: x for n, x in ref.items() if n not in ("alibi_slopes", "dropout_masks")}
        if "alibi_slopes" in ref:
            var["alibi_slopes"] = ref["alibi_slopes"][b]
        if "dropout_masks" in ref:
            var["dropout_mask"] = ref["dropout_masks"][b][None]
        # floor: flash-attn's rounding slack where the baseline is exact (dq = 0 at nq = nk = 1)
        assert_attention_right(*seq, causal=True, grads=grads, floor=ROUNDING, **var)
    if "sinks" in kern:
        assert_close(got[3], want[3], atol=2e-2, rtol=2e-2, name="dsinks")


def test_max_seqlen_one_and_an_all_empty_batch():
    """Every sequence of length 1 (max_seqlen = 1: the lengths Triton may specialise); a batch whose
    sequences are all empty, and one with no sequence: zeros, and no launch of an empty grid."""
    q, k, v, do = make_batch([1, 1, 1], [1, 1, 1], 2, 2, 16, seed=5)
    check_fp32(q, k, v, do, [1, 1, 1], [1, 1, 1], True, **COMBINED)
    for lq, lk in (([0, 0], [0, 0]), ([0, 0], [3, 2]), ([2, 1], [0, 0]), ([], [])):
        q, k, v, do = make_batch(lq, lk, 2, 1, 16, seed=6)
        dq, dk, dv, ds = check_fp32(q, k, v, do, lq, lk, False, sinks=True)
        assert not dq.any() and not dk.any() and not dv.any() and not ds.any()


def strided(x):
    """A copy of ``x (T, H, d)`` as a view with other strides: head-major storage with a padded head
    dim (token stride d + 3, head stride T·(d + 3); last dim contiguous)."""
    T, H, d = x.shape
    store = torch.zeros(H, T, d + 3, dtype=x.dtype, device=x.device)
    store[:, :, :d] = x.transpose(0, 1)
    view = store[:, :, :d].transpose(0, 1)
    assert not view.is_contiguous() and view.stride(-1) == 1
    return view


def test_non_contiguous_strides():
    H, HKV, d, lq, lk = CASES["ragged-empty-gqa"]
    q, k, v, do = make_batch(lq, lk, H, HKV, d, seed=7)
    check_fp32(q, k, v, do, lq, lk, True, views=strided, window=(3, 1), alibi=True)


def test_deterministic_bit_for_bit():
    """Two runs give the same bits (no atomics: every output element is written by one program)."""
    H, HKV, d, lq, lk = 4, 2, 24, [13, 0, 21], [17, 4, 21]
    q, k, v, do = make_batch(lq, lk, H, HKV, d, seed=8)
    kern, ref = make_variants(lq, lk, H, **COMBINED)
    first, _ = run(q, k, v, do, lq, lk, True, kern, ref, cfg=SMALL)
    second, _ = run(q, k, v, do, lq, lk, True, kern, ref, cfg=SMALL)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variants", [{}, dict(dropout_p=0.3, alibi=True, window=(4, 1))],
                         ids=["plain", "variants"])
def test_equal_lengths_match_the_dense_backward_bitwise(variants):
    """B sequences of one length each are a dense (B, H, N, d) batch: the varlen kernels compute
    exactly what the dense ones do (the same tiles in the same order, dropout's counters
    offset + b·H·N·Nk + h·N·Nk are the dense ones), bit for bit."""
    B, H, HKV, nq, nk, d = 3, 4, 2, 19, 26, 16
    q, k, v, do = make_batch([nq] * B, [nk] * B, H, HKV, d, seed=9)
    kern, ref = make_variants([nq] * B, [nk] * B, H, **variants)
    got, _ = run(q, k, v, do, [nq] * B, [nk] * B, True, kern, ref, cfg=SMALL)
    scale = d ** -0.5
    dense = [x.reshape(B, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v, do)]
    o, lse = reference_varlen(q, k, v, cu([nq] * B), cu([nk] * B), causal=True, scale=scale, **ref)
    o = torch.from_numpy(o).float().reshape(B, nq, H, d).transpose(1, 2).to(DEVICE)
    lse = torch.from_numpy(lse).float().reshape(H, B, nq).transpose(0, 1).contiguous().to(DEVICE)
    want = fa2_bwd_v2.backward(*dense[:3], o, lse, dense[3], causal=True, scale=scale, config_dkdv=SMALL,
                               config_dq=SMALL, **kern)
    for a, b in zip(got, want):
        assert torch.equal(a, b.transpose(1, 2).reshape(a.shape))


def test_triton_forward_then_backward():
    """The varlen Triton forward's o and lse (fa2_fwd_v1.forward_varlen) into this backward, every
    variant on: the two agree on layouts and on dropout's counters (gradients within 1e-4)."""
    from flashlib.kernels.triton import fa2_fwd_v1
    H, HKV, d, lq, lk = 4, 2, 24, [0, 11, 1, 20], [3, 14, 1, 9]
    q, k, v, do = make_batch(lq, lk, H, HKV, d, seed=11)
    kern, ref = make_variants(lq, lk, H, **COMBINED)
    cq, ck, scale = cu(lq), cu(lk), d ** -0.5
    o, lse = fa2_fwd_v1.forward_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, scale=scale,
                                       config=SMALL, **kern)
    got = fa2_bwd_v2.backward_varlen(q, k, v, o, lse, do, cq, ck, max(lq), max(lk), causal=True,
                                     scale=scale, config_dkdv=SMALL, config_dq=SMALL, **kern)
    *_, want = reference_varlen(q, k, v, cq, ck, causal=True, scale=scale, do=do, **ref)
    for a, b, name in zip(got, want, ("dq", "dk", "dv", "dsinks")):
        assert_close(a, b, atol=1e-4, rtol=1e-4, name=name)


def test_bad_cu_seqlens_read_nothing_out_of_bounds():
    """cu_seqlens are never read back on a GPU: the kernels clamp a sequence into the tensors (start in
    [0, T], length in [0, min(max_seqlen, T - start)]), so decreasing or overlong ones give finite
    gradients, not a fault. (flashlib.attention_varlen refuses them on a CPU.)"""
    q, k, v, do = make_batch([8], [8], 2, 1, 16, seed=10)
    o, lse = torch.zeros_like(q), torch.zeros(2, 8, device=DEVICE)
    bad_q = torch.tensor([0, 6, 3, 50], dtype=torch.int32, device=DEVICE)
    bad_k = torch.tensor([-4, 8, 2, 40], dtype=torch.int32, device=DEVICE)
    grads = fa2_bwd_v2.backward_varlen(q, k, v, o, lse, do, bad_q, bad_k, 8, 8, causal=True, scale=0.25,
                                       config_dkdv=SMALL, config_dq=SMALL)
    assert all(torch.isfinite(g).all() for g in grads)


# ------------------------------------------------------------------ compiling for the GPUs, with no GPU

# The VARLEN kernels as their specs launch them, plain and with every variant flag on.
_VARIANT_FLAGS = dict(WINDOW=True, SOFTCAP=True, ALIBI=True, DROPOUT=True)
def varlen_rows(archs=("sm_75", "sm_80", "sm_90"), dtype="fp16", triton=None):
    """The compile report's rows (flashlib.tools.compile_report) of the VARLEN kernels, plain and with
    every variant, at d = 128 causal with the config each arch's table picks, compiled with the
    installed Triton or ``triton`` (e.g. "3.2.0") through the report's own children and disk cache
    (compile_report.compile_specs names the VARLEN specs to the child)."""
    from flashlib.kernels.triton import configs
    from flashlib.tools import compile_report as cr
    version = cr._version(triton)
    jobs = []
    for arch in archs:
        for spec in (fa2_bwd_v2.DKDV_VARLEN_SPEC, fa2_bwd_v2.DQ_VARLEN_SPEC):
            cfg = configs.arch_config(spec, arch, cr.REPORT_HEAD_DIM, cr.tile_bytes(dtype, arch, version))
            for name, flags in (("", {}), (" variants", _VARIANT_FLAGS)):
                job = cr._job(spec, arch, dtype, version, cr.REPORT_HEAD_DIM, cfg)
                job["constexprs"].update(flags)
                job["label"] += name
                jobs.append(job)
    return cr._rows_of(jobs)


def test_varlen_kernels_compile_for_turing_ampere_and_hopper():
    require_module("triton")
    require_tool("ptxas")
    require_tool("cuobjdump")
    rows = varlen_rows()
    assert len(rows) == 12
    for r in rows:
        assert r["ok"], (r["kernel"], r["arch"], r["error"])
        assert "causal" in r["config"] and r["registers"] > 0
        # tensor cores where this Triton uses them (not sm_75 with triton >= 3.3)
        assert (r["mma_instructions"] > 0) == bool(r["tensor_cores"]), r
