"""Tests of the Triton forward on ragged (packed) batches, flashlib/kernels/triton/fa2_fwd_v1.py's
forward_varlen (the kernel's VARLEN switch), on conftest's DEVICE, against the float64 oracle
(flashlib.testing.reference_varlen: reference_gqa on each sequence alone): float32 within 2e-5,
float16/bfloat16 by FlashAttention's rule (assert_attention_right).

Shapes are tiny (Triton's interpreter) but adversarial, with forced small blocks (Config(16, 16)):
empty sequences (no query, no key, neither), length 1, lengths no block divides, nq_b != nk_b both ways
(causal rows that see no key), GQA, head dims 40 and 59, every variant alone and all combined (ALiBi's
slopes per sequence, dropout on the per-sequence counters from offset + b·H·max_q·max_k), strided
views (a token-major view of a padded buffer, head-major storage, a packed kv buffer). Also: a packed
batch gives each sequence bit for bit what it gets alone, whatever max_q (programs past a sequence's
end exit and write nothing); equal lengths are the dense forward bit for bit; the dropout mask reads back
as keep_mask's; a NaN stays in its own sequence; hypothesis over random ragged batches and variant
combinations. And the VARLEN kernel (alone and with every variant) compiles for sm_75, sm_80 and sm_90
with the installed Triton, with no more than a few spilled bytes (flashlib.tools.compile_report's
machinery and cache).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, require_module, require_tool
from test_triton_variants_fwd import VARIANTS
from triton_cases import VARIANT_SEED as SEED, make_qkv

from flashlib.kernels.triton import fa2_fwd_v1
from flashlib.kernels.triton.configs import Config
from flashlib.ladder.dropout import keep_mask
from flashlib.testing import assert_attention_right, assert_close, reference_varlen

SMALL = Config(16, 16)             # several key and query blocks on short sequences


def cu(lengths) -> torch.Tensor:
    """cu_seqlens, int32 (B + 1,), on DEVICE."""
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=DEVICE)


def pack(lens_q, lens_k, H, HKV, D, dtype=torch.float32, seed=0):
    """Token-major ``q (Tq, H, D)``, ``k, v (Tk, HKV, D)``, ``do`` like q, and ``cu_q``, ``cu_k``:
    drawn on the CPU from one seeded generator, then moved to DEVICE in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    shapes = ((tq, H, D), (tk, HKV, D), (tk, HKV, D), (tq, H, D))
    return [torch.randn(*s, generator=g).to(DEVICE, dtype) for s in shapes] + [cu(lens_q), cu(lens_k)]


def seq(x, cu_x, b):
    """Sequence b of the token-major ``x`` as a dense ``(1, heads, n, d)`` view."""
    return x[int(cu_x[b]):int(cu_x[b + 1])].transpose(0, 1)[None]


def make_variants(B, H, *, window=(-1, -1), softcap=0.0, alibi=False, sinks=False, dropout_p=0.0,
                  seed=SEED):
    """The variants as forward_varlen takes them (alibi_slopes float32 (B, H), sinks (H,),
    dropout_seed=(seed, offset)); ``triton_cases.make_variants``' for a packed batch (its dropout mask
    is per sequence: :func:`oracle` makes it)."""
    g = torch.Generator().manual_seed(1000)
    kern = {}
    if tuple(window) != (-1, -1):
        kern["window_size"] = tuple(window)
    if softcap:
        kern["softcap"] = float(softcap)
    if alibi:
        kern["alibi_slopes"] = (torch.rand(B, H, generator=g) * 0.5 + 0.05).to(DEVICE)
    if sinks:
        kern["sinks"] = torch.randn(H, generator=g).to(DEVICE)
    if dropout_p:
        kern.update(dropout_p=dropout_p, dropout_seed=seed)
    return kern


def seq_mask(kern, b, H, nq, nk, max_q, max_k):
    """Sequence b's dropout keep mask (1, H, nq, nk): the dense mask of its own problem, from
    offset + b·H·max_q·max_k (flashlib.attention_varlen's definition)."""
    seed, offset = kern["dropout_seed"]
    return keep_mask(seed, offset + b * H * max_q * max_k, (1, H, nq, nk), kern["dropout_p"])


def numpy_variants(kern) -> dict:
    """The variants as the oracle takes them (NumPy arrays; no dropout seed)."""
    return {n: x.cpu().numpy() if torch.is_tensor(x) else x for n, x in kern.items() if n != "dropout_seed"}


def oracle_kw(kern, b, H, nq, nk, max_q, max_k) -> dict:
    """reference_gqa's variants for sequence b alone: its row of the slopes, its dropout mask."""
    ref = numpy_variants(kern)
    if "alibi_slopes" in ref:
        ref["alibi_slopes"] = ref["alibi_slopes"][b:b + 1]
    if "dropout_p" in ref:
        ref["dropout_mask"] = seq_mask(kern, b, H, nq, nk, max_q, max_k)
    return ref


def oracle(q, k, v, cu_q, cu_k, max_q, max_k, causal, kern):
    """The float64 ``(o (Tq, H, d), lse (H, Tq))`` of a packed batch (flashlib.testing.reference_varlen:
    each sequence alone; queries with no key: o = 0, lse = -inf or the sink)."""
    ref, H = numpy_variants(kern), q.shape[1]
    if "dropout_p" in ref:
        lens = [(int(cu_q[b + 1] - cu_q[b]), int(cu_k[b + 1] - cu_k[b])) for b in range(len(cu_q) - 1)]
        ref["dropout_masks"] = [seq_mask(kern, b, H, nq, nk, max_q, max_k)[0]
                                for b, (nq, nk) in enumerate(lens)]
    return reference_varlen(q, k, v, cu_q, cu_k, causal=causal, **ref)


def run(q, k, v, cu_q, cu_k, causal, kern=None, config=SMALL, max_q=None, max_k=None):
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if max_q is None else max_q
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if max_k is None else max_k
    return fa2_fwd_v1.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                     scale=q.shape[-1] ** -0.5, config=config, **(kern or {}))


def assert_fp32_right(q, k, v, cu_q, cu_k, causal, kern=None):
    kern = kern or {}
    o, lse = run(q, k, v, cu_q, cu_k, causal, kern)
    assert o.shape == q.shape and o.is_contiguous() and lse.shape == (q.shape[1], q.shape[0])
    max_q, max_k = (int((c[1:] - c[:-1]).max()) for c in (cu_q, cu_k))
    o_ref, lse_ref = oracle(q, k, v, cu_q, cu_k, max_q, max_k, causal, kern)
    assert_close(o, o_ref, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, name="lse")
    return o, lse


# (lens_q, lens_k, H, HKV, D): empty sequences (no query; no key; neither), length 1, lengths no block
# of 16 divides, nq_b > nk_b (causal rows that see no key) and nq_b < nk_b, GQA and MQA, d = 40, 59
CASES = {
    "mixed-gqa-d40": ([5, 0, 17, 1, 0, 33, 1], [9, 4, 17, 0, 0, 20, 1], 4, 2, 40),
    "mqa-d59": ([19, 3, 40], [7, 40, 23], 2, 1, 59),
    "one-token": ([1], [1], 3, 3, 16),
    "one-long": ([37], [50], 2, 2, 24),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(CASES))
def test_each_sequence_matches_the_oracle_fp32(name, causal):
    lens_q, lens_k, H, HKV, D = CASES[name]
    q, k, v, _, cu_q, cu_k = pack(lens_q, lens_k, H, HKV, D, seed=1)
    o, lse = assert_fp32_right(q, k, v, cu_q, cu_k, causal)
    # a sequence with queries and no key: o = 0, lse = -inf (exactly)
    for b in np.flatnonzero((np.array(lens_k) == 0) & (np.array(lens_q) > 0)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.all(o[rows] == 0) and torch.all(lse[:, rows] == float("-inf"))


# nq_b < nk_b, an empty sequence, nq_b > nk_b, a sequence with no key; GQA
VARIANT_LENS = ([13, 0, 21, 6], [21, 5, 9, 0])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_and_all_combined_per_sequence_fp32(name, causal):
    q, k, v, _, cu_q, cu_k = pack(*VARIANT_LENS, 4, 2, 16, seed=2)
    kern = make_variants(len(VARIANT_LENS[0]), 4, **VARIANTS[name])
    assert_fp32_right(q, k, v, cu_q, cu_k, causal, kern)


@pytest.mark.parametrize("dtype, name", [(torch.float16, "none"), (torch.float16, "all"),
                                         (torch.bfloat16, "all")], ids=str)
def test_half_precision_within_flashattention_rule(dtype, name):
    lens_q, lens_k = [45, 0, 7, 20], [70, 3, 0, 33]
    q, k, v, do, cu_q, cu_k = pack(lens_q, lens_k, 4, 2, 40, dtype=dtype, seed=3)
    kern = make_variants(4, 4, **VARIANTS.get(name, {}))
    o, lse = run(q, k, v, cu_q, cu_k, True, kern)
    for b in range(4):
        if lens_q[b] and lens_k[b]:
            ref = oracle_kw(kern, b, 4, lens_q[b], lens_k[b], max(lens_q), max(lens_k))
            assert_attention_right(seq(q, cu_q, b), seq(k, cu_k, b), seq(v, cu_k, b), seq(do, cu_q, b),
                                   causal=True, o=seq(o, cu_q, b), lse=lse[None, :, int(cu_q[b]):int(cu_q[b + 1])],
                                   **ref)


# No dropout here: its counters depend on b and on max_q, max_k, so alone they differ.
ALONE = dict(window=(8, 2), softcap=2.0, alibi=True, sinks=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_packed_sequence_gets_what_it_gets_alone_whatever_max_q(causal):
    """Bit for bit: no program writes outside its own sequence's rows, and the programs a larger max_q
    or max_k adds (past every sequence's end) exit without writing."""
    lens_q, lens_k = [33, 0, 2, 17, 5], [10, 6, 40, 17, 0]
    q, k, v, _, cu_q, cu_k = pack(lens_q, lens_k, 4, 2, 16, seed=4)
    kern = make_variants(5, 4, **ALONE)
    o, lse = run(q, k, v, cu_q, cu_k, causal, kern)
    o_big, lse_big = run(q, k, v, cu_q, cu_k, causal, kern, max_q=80, max_k=64)
    assert torch.equal(o, o_big) and torch.equal(lse, lse_big)
    for b in range(5):
        if not lens_q[b]:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        alone = dict(kern, alibi_slopes=kern["alibi_slopes"][b:b + 1].contiguous())
        o_b, lse_b = run(q[rows], k[keys], v[keys], cu([lens_q[b]]), cu([lens_k[b]]), causal, alone)
        assert torch.equal(o[rows], o_b) and torch.equal(lse[:, rows], lse_b), b


@pytest.mark.parametrize("variants", ["none", "all"])
def test_equal_lengths_are_the_dense_forward_bit_for_bit(variants):
    """B sequences of one length: the dense forward's (B, H, N, d) problem, its dropout counters
    included (b·H·N·N + h·N·N = (b·H + h)·N·N)."""
    B, H, HKV, N, D = 3, 4, 2, 21, 16
    q, k, v, _ = make_qkv(B, H, HKV, N, N, D, seed=5, device=DEVICE)
    kern = make_variants(B, H, **VARIANTS.get(variants, {}))
    o, lse = fa2_fwd_v1.forward(q, k, v, causal=True, scale=D ** -0.5, config=SMALL, **kern)

    def tokens(x):
        return x.transpose(1, 2).reshape(-1, x.shape[1], D)
    o_var, lse_var = run(tokens(q), tokens(k), tokens(v), cu([N] * B), cu([N] * B), True, kern)
    assert torch.equal(o_var, tokens(o)) and torch.equal(lse_var, lse.transpose(0, 1).reshape(H, B * N))


def test_strided_views_need_no_copy_and_give_the_same_bits():
    """Any strides with a contiguous last dim: q from a padded buffer (T, H, d + 8)[..., :d], k from
    head-major storage (Hkv, T, d).transpose(0, 1), v from a packed kv buffer (T, 2, Hkv, d)[:, 1]."""
    lens_q, lens_k, H, HKV, D = [7, 0, 19], [12, 3, 19], 4, 2, 24
    q, k, v, _, cu_q, cu_k = pack(lens_q, lens_k, H, HKV, D, seed=6)
    q_view = torch.zeros(q.shape[0], H, D + 8, device=DEVICE)[..., :D]
    q_view.copy_(q)
    k_view = k.transpose(0, 1).contiguous().transpose(0, 1)
    kv = torch.stack([k, v], 1)
    v_view = kv[:, 1]
    assert not (q_view.is_contiguous() or k_view.is_contiguous() or v_view.is_contiguous())
    for causal in (False, True):
        o, lse = run(q, k, v, cu_q, cu_k, causal)
        o_s, lse_s = run(q_view, k_view, v_view, cu_q, cu_k, causal)
        assert torch.equal(o, o_s) and torch.equal(lse, lse_s)
    assert_fp32_right(q_view, k_view, v_view, cu_q, cu_k, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_mask_is_each_sequences_keep_mask_bit_for_bit(causal):
    """With V = I per sequence (value row j is the unit vector e_j) o[i, j] = P_ij Z_ij / (1 - p): the
    kernel's mask reads back, and is keep_mask of sequence b's own (1, H, nq_b, nk_b) problem from
    offset + b·H·max_q·max_k, on every element a row sees; the counters cross 2^32 inside a row."""
    lens_q, lens_k, H, p = [7, 12, 3], [30, 16, 5], 2, 0.4
    seed = (3, 2**32 - 300)
    q, k, _, _, cu_q, cu_k = pack(lens_q, lens_k, H, H, 32, seed=7)
    v = torch.cat([torch.eye(n, 32, device=DEVICE)[:, None].expand(n, H, 32) for n in lens_k])
    o, _ = run(q, k, v, cu_q, cu_k, causal, dict(dropout_p=p, dropout_seed=seed))
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        z = keep_mask(seed[0], seed[1] + b * H * max(lens_q) * max(lens_k), (1, H, nq, nk), p)[0]
        seen = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq if causal else True
        got = (seq(o, cu_q, b)[0, ..., :nk] != 0).cpu().numpy()
        assert np.array_equal(got, z & seen), b


def test_a_nan_stays_in_its_own_sequence():
    """A NaN in one sequence's keys and values makes only that sequence's rows NaN (flashlib's NaN
    rule); its neighbours in the packed buffers, before and after it, are untouched."""
    lens_q, lens_k = [9, 14, 6], [11, 17, 8]
    q, k, v, _, cu_q, cu_k = pack(lens_q, lens_k, 2, 1, 16, seed=9)
    o, lse = run(q, k, v, cu_q, cu_k, False)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[int(cu_k[1]) + 3, 0, 2] = float("nan")
    v_nan[int(cu_k[1]) + 5, 0, 7] = float("nan")
    o_nan, lse_nan = run(q, k_nan, v_nan, cu_q, cu_k, False)
    mid = slice(int(cu_q[1]), int(cu_q[2]))
    assert torch.isnan(o_nan[mid]).all(dim=-1).all() and torch.isnan(lse_nan[:, mid]).all()
    for rows in (slice(0, int(cu_q[1])), slice(int(cu_q[2]), None)):
        assert torch.equal(o_nan[rows], o[rows]) and torch.equal(lse_nan[:, rows], lse[:, rows])


def test_hypothesis_over_ragged_batches_and_variants():
    """Random packed batches (1 to 4 sequences of 0 to 20 queries and keys), causal or not, with any
    combination of the variants, fp32 against the oracle."""
    require_module("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    side = st.one_of(st.just(-1), st.integers(0, 12))
    lengths = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=4)

    @settings(max_examples=30, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(lens=lengths, group=st.sampled_from([1, 2]), causal=st.booleans(), window=st.tuples(side, side),
           softcap=st.sampled_from([0.0, 1.5]), alibi=st.booleans(), sinks=st.booleans(),
           dropout_p=st.sampled_from([0.0, 0.3]))
    def check(lens, group, causal, window, softcap, alibi, sinks, dropout_p):
        lens_q, lens_k = [n for n, _ in lens], [n for _, n in lens]
        if not any(lens_q):
            return
        q, k, v, _, cu_q, cu_k = pack(lens_q, lens_k, 2 * group, 2, 16, seed=sum(lens_q) * 31 + sum(lens_k))
        kern = make_variants(len(lens), 2 * group, window=window, softcap=softcap, alibi=alibi, sinks=sinks,
                             dropout_p=dropout_p)
        assert_fp32_right(q, k, v, cu_q, cu_k, causal, kern)

    check()


def test_no_query_at_all_launches_nothing():
    q, k, v, _, cu_q, cu_k = pack([0, 0], [3, 0], 2, 1, 16, seed=8)
    o, lse = run(q, k, v, cu_q, cu_k, True, max_q=0)
    assert o.shape == (0, 2, 16) and lse.shape == (2, 0)


# ------------------------------------------------------------------ what the VARLEN kernel compiles to

ALL_VARIANTS = dict(WINDOW=True, SOFTCAP=True, ALIBI=True, SINK=True, DROPOUT=True)
# Spilled bytes VARLEN may add to the kernel it switches on (ptxas -v). The dense kernel with every
# variant on already spills (452 bytes at sm_80's largest tile, M128-N64, triton 3.9); VARLEN alone
# spills nothing (its sequence start folds into the scalar base pointers; (start + rows) · stride, a
# 64-bit vector per tile, took sm_80 from 190 registers to 255 and 68 spilled bytes).
SPILL_SLACK = 32


def test_the_varlen_kernel_compiles_for_sm75_sm80_sm90_without_a_spill_explosion():
    """Each arch's fp16 table config at d = 128 (the compile report's problem: causal), VARLEN alone
    and with every variant, against the same kernel without VARLEN (the dense job is the report's own,
    from its cache): compiles, uses the same shared memory and tensor-core instructions, and spills at
    most SPILL_SLACK bytes more."""
    require_module("triton")
    require_tool("ptxas")
    require_tool("cuobjdump")
    from flashlib.kernels.triton import configs
    from flashlib.tools import compile_report as fi
    version = fi._version(None)
    jobs = []
    for arch in ("sm_75", "sm_80", "sm_90"):
        cfg = configs.arch_config(fa2_fwd_v1.SPEC, arch, 128, fi.tile_bytes("fp16", arch, version))
        for name, flags in (("", {}), (" varlen", dict(VARLEN=True)), (" variants", ALL_VARIANTS),
                            (" varlen variants", dict(ALL_VARIANTS, VARLEN=True))):
            job = fi._job(fa2_fwd_v1.SPEC, arch, "fp16", version, 128, cfg)
            job["constexprs"].update(flags)
            job["label"] += name
            jobs.append(job)
    rows = fi._rows_of(jobs)
    assert all(r["ok"] for r in rows), [(r["config"], r["arch"], r["error"]) for r in rows if not r["ok"]]
    for dense, varlen in zip(rows[0::2], rows[1::2]):
        assert varlen["spill_bytes"] <= dense["spill_bytes"] + SPILL_SLACK, (dense, varlen)
        assert varlen["shared_bytes"] == dense["shared_bytes"], (dense, varlen)
        assert varlen["mma_instructions"] == dense["mma_instructions"], (dense, varlen)
