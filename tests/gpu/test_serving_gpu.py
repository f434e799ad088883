"""GPU tier: serving (issue 25) on the compiled Triton kernels, at sizes that reach the real configs.

The CPU suite proves the semantics on small shapes in the interpreter (tests/test_api_serving.py,
tests/kernels/triton/test_triton_varlen_*.py, test_triton_paged_decode.py, tests/serving/); here the
compiled kernels must give the same on CUDA tensors:

* flashlib.attention_varlen, forward and backward, against the float64 oracle sequence by sequence
  (flashlib.testing.assert_attention_right: fp32 tightly, fp16/bf16 under FlashAttention's rule) on
  adversarial lengths (empty sequences, queries without keys, length 1, lengths no block divides, more
  queries than keys) with every variant; dsinks, summed over the sequences, under the same rule;
* the varlen backward bit for bit deterministic at ~1000 tokens, d = 128;
* paged decode bit for bit the dense decode on the same keys and values (page sizes 1, 3, 16, 256,
  pages shuffled and shared), with causal new tokens and the variants;
* decode with an in-place append through a block table captured in a CUDA graph and replayed with
  other lengths, and neither varlen nor paged decode reading anything back to the host;
* flashlib.serving's engine giving, on the GPU, the tokens of generating each request alone.

dtypes are chosen by capability when collected (bfloat16 from sm_80: flashlib.hardware.kernel_dtypes).
"""
from __future__ import annotations

import pytest
import torch

import flashlib
from flashlib.hardware import kernel_dtypes
from flashlib.testing import assert_attention_right, assert_fa_rule, plain_torch_attention, reference_varlen

DEVICE = torch.device("cuda")
DTYPES = [getattr(torch, n) for n in kernel_dtypes(DEVICE)]
FLOOR = 1e-5
H, HKV, D = 8, 2, 128
# (query lengths, key lengths) per sequence: self-attention packed (q == k), then cross lengths with an
# empty sequence, queries without keys, a sequence of one token and more queries than keys
LENGTHS = {
    "packed": ([1, 0, 17, 129, 300, 64, 500], [1, 0, 17, 129, 300, 64, 500]),
    "ragged": ([3, 0, 77, 1, 250, 40, 300], [0, 5, 300, 129, 511, 1, 200]),
}


def _variants(name, batch, device=DEVICE):
    g = torch.Generator().manual_seed(1)
    slopes = (2.0 ** (-8.0 * torch.arange(1, H + 1) / H)).float()              # ALiBi's geometric slopes
    sinks = torch.randn(H, generator=g).float()
    per_sequence = slopes[None] * torch.rand(batch, 1, generator=g)           # (B, H): one row per sequence
    return {
        "plain": {},
        "window": dict(window_size=(63, 0)),
        "window_both": dict(window_size=(100, 17)),
        "softcap": dict(softcap=5.0),
        "alibi": dict(alibi_slopes=per_sequence.to(device)),
        "sinks": dict(sinks=sinks.to(device)),
        "all": dict(window_size=(127, 0), softcap=30.0, alibi_slopes=slopes.to(device),
                    sinks=sinks.to(device)),
    }[name]


def _packed(q_lens, k_lens, dtype, seed=0, d=D):
    """Packed q ``(Tq, H, d)``, k, v ``(Tk, Hkv, d)``, do, and int32 cu_seqlens, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens), sum(k_lens)
    q, k, v, do = (torch.randn(t, h, d, generator=g).to(DEVICE, dtype)
                   for t, h in ((tq, H), (tk, HKV), (tk, HKV), (tq, H)))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
                  for lens in (q_lens, k_lens))
    return q, k, v, do, cu_q, cu_k


def _dense(x, rows):
    """Rows ``rows`` of a packed ``(T, heads, d)`` tensor as one dense ``(1, heads, n, d)`` problem."""
    return x[rows].transpose(0, 1)[None]


def _sequence_variants(kw, b):
    """The variants of sequence b for the dense oracle, as NumPy: its row of per-sequence ALiBi slopes."""
    out = {}
    for name, x in kw.items():
        if isinstance(x, torch.Tensor):
            x = x.detach().double().cpu()
            x = (x[b] if name == "alibi_slopes" and x.dim() == 2 else x).numpy()
        out[name] = x
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["plain", "window", "window_both", "softcap", "alibi", "sinks", "all"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_varlen_forward_and_backward_follow_the_oracle_sequence_by_sequence(lengths, causal, name, dtype):
    q_lens, k_lens = LENGTHS[lengths]
    q, k, v, do, cu_q, cu_k = _packed(q_lens, k_lens, dtype)
    kw = _variants(name, len(q_lens))
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].clone().requires_grad_()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = flashlib.attention_varlen(*leaves, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal,
                                       return_lse=True, backend="triton", **kw)
    assert o.shape == q.shape and lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    o.backward(do)
    dq, dk, dv = (x.grad for x in leaves)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    base_dsinks = torch.zeros(H, dtype=torch.float64)
    for b in range(len(q_lens)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.start == rq.stop:
            continue
        if rk.start == rk.stop:                         # queries without keys: 0, and no gradient
            assert not o[rq].any() and not dq[rq].any(), b
            continue
        assert_attention_right(_dense(q, rq), _dense(k, rk), _dense(v, rk), _dense(do, rq), causal=causal,
                               o=_dense(o.detach(), rq), lse=lse.detach()[:, rq][None],
                               grads=[_dense(dq, rq), _dense(dk, rk), _dense(dv, rk)], floor=FLOOR,
                               **_sequence_variants(kw, b))
        if "sinks" in kw:                               # the plain same-dtype baseline's share of dsinks
            sinks = kw["sinks"].detach().to(dtype).requires_grad_()
            seq_kw = {n: (x[b] if n == "alibi_slopes" and x.dim() == 2 else x)
                      for n, x in kw.items() if n != "sinks"}
            base = plain_torch_attention(_dense(q, rq), _dense(k, rk), _dense(v, rk), causal=causal,
                                         sinks=sinks, **seq_kw)
            base_dsinks += torch.autograd.grad(base, sinks, _dense(do, rq))[0].double().cpu()
    if "sinks" in kw:                                   # dsinks: one (H,) summed over every sequence
        oracle = {n: x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else x
                  for n, x in kw.items()}
        want = reference_varlen(q, k, v, cu_q, cu_k, causal=causal, do=do, **oracle)[2][3]
        if dtype == torch.float32:
            torch.testing.assert_close(kw["sinks"].grad.double().cpu(), torch.from_numpy(want),
                                       atol=1e-3, rtol=1e-3)
        else:
            assert_fa_rule(kw["sinks"].grad, base_dsinks, want, factor=3.0, floor=FLOOR, name="dsinks")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_backward_is_bit_for_bit_deterministic(dtype):
    """~1000 tokens, d = 128, every variant at once: three backward passes give the same bits."""
    lens = [1, 129, 300, 64, 500]                       # 994 tokens
    q, k, v, do, cu, _ = _packed(lens, lens, dtype, seed=3)
    kw = _variants("all", len(lens))
    runs = []
    for _ in range(3):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        sinks = kw["sinks"].clone().requires_grad_()
        o = flashlib.attention_varlen(*leaves, cu, cu, max(lens), max(lens), causal=True, backend="triton",
                                      **{**kw, "sinks": sinks})
        runs.append(torch.autograd.grad(o, [*leaves, sinks], do))
    for run in runs[1:]:
        for got, first in zip(run, runs[0]):
            assert torch.equal(got, first)


def test_varlen_forward_and_backward_never_sync():
    lens = [3, 0, 300, 129]
    q, k, v, do, cu, _ = _packed(lens, lens, torch.float16, seed=4)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def call():
        return flashlib.attention_varlen(*leaves, cu, cu, 300, 300, causal=True, backend="triton")
    call().backward(do)                                  # compiled outside the debug mode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(call(), leaves, do)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- paged decode -------------------------------------------------------------------------------------
def _paged(dense, page_size, gen, share=True):
    """The dense cache ``(B, Hkv, Nmax, d)`` (Nmax a multiple of page_size) as shuffled pages
    ``(num_pages, page_size, Hkv, d)`` and its int32 block table; with ``share``, sequence 1's first
    page is sequence 0's (the two caches begin with the same tokens: copied so in ``dense`` too)."""
    b, hkv, nmax, d = dense.shape
    per = nmax // page_size
    if share and b > 1:
        dense[1, :, :page_size] = dense[0, :, :page_size]
    order = torch.randperm(b * per, generator=gen).to(dense.device)
    table = order.view(b, per).clone()
    chunks = dense.transpose(1, 2).reshape(b * per, page_size, hkv, d)
    pages = torch.full_like(chunks, float("nan"))       # pages no sequence uses hold NaN: never read
    pages[order] = chunks
    if share and b > 1:
        pages[table[1, 0]] = float("nan")               # sequence 1's own first page: unused now
        table[1, 0] = table[0, 0]
    return pages, table.to(torch.int32)


DECODE_VARIANTS = ["plain", "causal", "window", "softcap", "alibi", "sinks", "all"]


def _decode_variants(name, batch):
    if name == "causal":
        return dict(causal=True)
    kw = _variants(name, batch)
    if name == "all":
        kw["causal"] = True
    return kw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", DECODE_VARIANTS)
@pytest.mark.parametrize("page_size, num_splits", [(1, None), (3, 3), (16, None), (256, 2)])
def test_paged_decode_is_bit_for_bit_the_dense_decode(page_size, num_splits, name, dtype):
    """The same keys and values, the same lengths and splits over the same logical ranges: the same bits.
    Three new queries per sequence (speculative decoding: causal among themselves where asked); the
    split count the default rule picks, or a fixed one."""
    batch, nq = 4, 3
    capacity = -(-1037 // page_size) * page_size
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, H, nq, D, generator=g).to(DEVICE, dtype)
    kc, vc = (torch.randn(batch, HKV, capacity, D, generator=g).to(DEVICE, dtype) for _ in "kv")
    (kp, table), (vp, table_v) = (_paged(x, page_size, torch.Generator().manual_seed(6)) for x in (kc, vc))
    assert torch.equal(table, table_v)
    lens = torch.tensor([1037, 0, 513, 1], dtype=torch.int32, device=DEVICE)
    kw = _decode_variants(name, batch)
    dense = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                            backend="triton", **kw)
    paged = flashlib.decode(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=num_splits,
                            return_lse=True, backend="triton", **kw)
    for got, want in zip(paged, dense):
        assert torch.equal(got, want)
    assert not paged[0].isnan().any()                  # no NaN page (unused, or past a length) was read


# ---- append through a block table in a CUDA graph ----------------------------------------------------
def _capture(fn):
    """Warm ``fn`` up on a side stream (Triton compiles, allocators settle), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _append_inputs(page_size=16, seed=0):
    batch, capacity = 3, 1040
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, 2, D, generator=g).to(DEVICE, torch.float16)
    k_new, v_new = (torch.randn(batch, 2, HKV, D, generator=g).to(DEVICE, torch.float16) for _ in "kv")
    kc, vc = (torch.randn(batch, HKV, capacity, D, generator=g).to(DEVICE, torch.float16) for _ in "kv")
    (kp, table), (vp, _) = (_paged(x, page_size, torch.Generator().manual_seed(seed + 1), share=False)
                            for x in (kc, vc))
    lens = torch.tensor([1000, 0, 513], dtype=torch.int32, device=DEVICE)
    return q, k_new, v_new, kp, vp, table, lens


def test_paged_decode_with_append_never_syncs():
    q, k_new, v_new, kp, vp, table, lens = _append_inputs()

    def call():
        return flashlib.decode(q, kp, vp, k=k_new, v=v_new, cache_seqlens=lens, block_table=table, causal=True,
                               backend="triton")
    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_decode_with_append_and_block_table_is_captured_and_replays_with_other_lengths():
    """Captured once, replayed after new queries, new tokens and new lengths are copied in: the replay
    appends at the new positions and attends to the new lengths (checked against the reference backend on
    the cache as the replay left it)."""
    q, k_new, v_new, kp, vp, table, lens = _append_inputs()

    def step():
        return flashlib.decode(q, kp, vp, k=k_new, v=v_new, cache_seqlens=lens, block_table=table, causal=True,
                               backend="triton")
    graph, out = _capture(step)
    q2, k2, v2, _, _, _, _ = _append_inputs(seed=7)
    for dst, src in ((q, q2), (k_new, k2), (v_new, v2)):
        dst.copy_(src)
    lens.copy_(torch.tensor([3, 1037, 200], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    page = kp.shape[1]
    for b, start in enumerate([3, 1037, 200]):          # the new tokens are in the pages at [len, len + 2)
        for t in range(2):
            pos = start + t
            row = kp[table[b, pos // page].long(), pos % page]
            assert torch.equal(row, k_new[b, t]), (b, t)
    want = flashlib.decode(q.cpu().float(), kp.cpu().float(), vp.cpu().float(),
                           cache_seqlens=(lens + 2).cpu(), block_table=table.cpu(), causal=True,
                           backend="reference")
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, step(), rtol=0, atol=0)     # an eager call: the same kernels, bits


# ---- the engine ---------------------------------------------------------------------------------------
def _engine_model(n_kv_head):
    from flashlib.models import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(64, 512, n_layer=3, n_head=4, n_kv_head=n_kv_head, n_embd=128)
    return GPT(cfg).eval().to(DEVICE)


def _alone(model, prompts, news):
    from flashlib.models import generate
    return [generate(model, torch.tensor([p], device=DEVICE), n, top_k=1)[0].tolist()
            for p, n in zip(prompts, news)]


@pytest.mark.parametrize("page_size, cascade, n_kv_head", [(16, True, None), (3, True, 2), (16, False, 2)])
def test_the_engine_gives_the_tokens_of_each_request_alone(page_size, cascade, n_kv_head):
    """Twelve requests, prompts of 5 to 300 tokens (some sharing a 40-token prefix), 4 to 24 new tokens,
    arriving over the first steps and under a page budget that makes some wait: continuous batching,
    varlen prefill, paged decode and (with cascade) the shared prefix merged, all on the compiled kernels,
    give each request's tokens as generating it alone does."""
    from flashlib.serving import generate as serve
    model = _engine_model(n_kv_head)
    g = torch.Generator().manual_seed(8)
    shared = torch.randint(0, 64, (40,), generator=g).tolist()
    lengths = [5, 300, 41, 77, 128, 60, 250, 17, 45, 199, 90, 64]
    prompts, prefix = [], []
    for i, n in enumerate(lengths):
        own = torch.randint(0, 64, (n,), generator=g).tolist()
        sharing = i % 3 == 0 and n > 40
        prompts.append(shared + own[40:] if sharing else own)
        prefix.append(40 if sharing else 0)
    news = [4 + (7 * i) % 21 for i in range(len(lengths))]
    arrivals = [i // 3 for i in range(len(lengths))]
    budget = sum(-(-(len(p) + n) // page_size) for p, n in zip(prompts, news)) // 2
    out, engine = serve(model, prompts, news, prefix=prefix, arrivals=arrivals, page_size=page_size,
                        num_pages=budget, cascade=cascade, backend="triton")
    assert out == _alone(model, prompts, news)
    assert engine.cache.allocator.in_use == 0
