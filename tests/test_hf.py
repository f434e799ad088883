"""flashlib.hf: transformers models run their attention in flashlib.

Tiny randomly initialised Llama, Mistral (sliding window shorter than the
sequence), Gemma 2 (logit softcapping, sliding and full layers) and gpt-oss
(attention sinks, sliding and full layers), float32 on a CPU, flashlib's
"reference" backend: logits as transformers' own eager attention's, the same
greedy tokens from ``generate()`` with a KV cache, and padded batches (left
padding in batched generation, right padding in a prompt) through
flashlib.attention_varlen with eager's logits on the real tokens and eager's
tokens; the masks flashlib cannot express refused.
The weights are drawn wide (``initializer_range=0.3``) so that attention is
peaked: dropping a variant moves the logits by far more than the tolerance
(each model test checks that it would notice).
"""
import pytest
import torch

from conftest import need_module

need_module("transformers")  # skip the module, saying why, where it is missing
from transformers import AttentionInterface  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import flashlib.api  # noqa: E402
from flashlib import hf  # noqa: E402
from flashlib.testing import reference_gqa  # noqa: E402

NAME = "FlashLibTest"          # registered with the float64-capable backend
TOL = dict(rtol=1e-5, atol=1e-5)
N, W = 20, 6                   # prompt length, sliding window (W < N)
MODELS = list(hf.TINY_MODELS)
# what each model's two layers pass to flashlib.attention (besides q, k, v)
EXPECTED = {
    "llama": [{}, {}],
    "mistral": [{"window_size": (W - 1, 0)}] * 2,
    "gemma2": [{"window_size": (W - 1, 0), "softcap": 2.0}, {"softcap": 2.0}],
    "gpt_oss": [{"window_size": (W - 1, 0), "sinks": (4,)}, {"sinks": (4,)}],
}
# the variant each model test drops once, to show the comparison notices
DROP = {"mistral": "window_size", "gemma2": "softcap", "gpt_oss": "sinks"}

hf.register(NAME, backend="reference")


class _Calls(list):
    drop = None


@pytest.fixture
def calls(monkeypatch):
    """Record every flashlib.attention / flashlib.decode call flashlib.hf
    makes (``fn``, its keyword arguments, tensors as shapes);
    ``calls.drop = name`` removes one keyword from the calls."""
    seen = _Calls()

    def spy(fn):
        original = getattr(flashlib.api, fn)

        def call(q, k, v, *args, **kw):
            seen.append(dict({n: tuple(a.shape) if torch.is_tensor(a) else a
                              for n, a in kw.items()},
                             fn=fn, q=tuple(q.shape), k=tuple(k.shape),
                             args=args))
            kw.pop(seen.drop, None)
            return original(q, k, v, *args, **kw)
        monkeypatch.setattr(flashlib.api, fn, call)

    seen.drop = None
    spy("attention")
    spy("decode")
    spy("attention_varlen")
    return seen


def _model(kind, **extra):
    return hf.tiny_model(kind, **extra)


def _ids(batch=2, n=N, seed=1):
    return torch.randint(0, 100, (batch, n),
                         generator=torch.Generator().manual_seed(seed))


def _logits(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kw).logits


def _variants(call):
    return {n: v for n, v in call.items()
            if n not in ("fn", "q", "k", "args", "causal", "scale", "backend")}


@pytest.mark.parametrize("kind", MODELS)
def test_logits_match_eager(kind, calls):
    model, ids = _model(kind), _ids()
    ones = torch.ones_like(ids)
    eager = _logits(model, "eager", ids, attention_mask=ones)
    ours = _logits(model, NAME, ids, attention_mask=ones)
    torch.testing.assert_close(ours, eager, **TOL)
    # each layer called flashlib once, GQA native, with its variants
    assert [c["k"] for c in calls] == [(2, 2, N, 8)] * 2
    assert [c["q"] for c in calls] == [(2, 4, N, 8)] * 2
    assert all(c["fn"] == "attention" and c["causal"] is True and
               c["backend"] == "reference" for c in calls)
    assert [_variants(c) for c in calls] == EXPECTED[kind]
    scale = model.model.layers[0].self_attn.scaling
    assert all(c["scale"] == scale for c in calls)
    # no mask without padding: None (no mask given) also runs
    torch.testing.assert_close(_logits(model, NAME, ids), eager, **TOL)
    if kind in DROP:           # dropping the variant is noticed
        calls.drop = DROP[kind]
        wrong = _logits(model, NAME, ids)
        assert (wrong - eager).abs().max() > 1e3 * TOL["atol"]


@pytest.mark.parametrize("kind", MODELS)
def test_greedy_generation_matches_eager(kind, calls):
    model, ids = _model(kind), _ids()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5,
              do_sample=False, pad_token_id=0)
    tokens = {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(ids, **kw)
    assert tokens[NAME].shape == (2, N + 5)
    assert torch.equal(tokens[NAME], tokens["eager"])
    # prefill in flashlib.attention, then 4 steps of one query each against
    # the cache in flashlib.decode (its window is bottom-right aligned too);
    # a sliding layer's cache keeps the last W - 1 keys: its steps see W keys
    assert len(calls) == 2 * 5
    for step, call in enumerate(calls):
        layer = step % 2
        assert _variants(call) == EXPECTED[kind][layer]
        if step < 2:
            assert call["fn"] == "attention" and call["causal"] is True
            assert call["q"][2] == call["k"][2] == N
            continue
        sliding = "window_size" in call
        past = N + step // 2 - 1
        assert call["fn"] == "decode" and call["q"][2] == 1
        assert call["k"][2] == (min(past, W - 1) if sliding else past) + 1


def _padded(batch=3, n=N, seed=1, right=False, pads=((0, 5), (2, 11))):
    """Token ids and a 2-D mask: ``pads`` ``(sequence, padding tokens)``, by
    default sequence 0 has 5 padding tokens, sequence 2 has 11 (more than
    the window W), sequence 1 none; on the left (batched generation) or on
    the right."""
    ids = _ids(batch, n, seed)
    mask = torch.ones_like(ids)
    for b, pad in pads:
        if b < batch:
            if right:
                mask[b, n - pad:] = 0
            else:
                mask[b, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("right", [False, True], ids=["left", "right"])
@pytest.mark.parametrize("kind", MODELS)
def test_padded_batch_logits_match_eager_on_the_real_tokens(kind, right,
                                                            calls):
    model = _model(kind)
    ids, mask = _padded(right=right)
    eager = _logits(model, "eager", ids, attention_mask=mask)
    ours = _logits(model, NAME, ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], eager[real], **TOL)
    # each layer: one flashlib.attention_varlen call on the real tokens only
    assert [c["fn"] for c in calls] == ["attention_varlen"] * 2
    lens = [N - 5, N, N - 11]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                      dtype=torch.int32)
    for layer, call in enumerate(calls):
        cu_q, cu_k, max_q, max_k = call["args"]
        assert torch.equal(cu_q, cu) and torch.equal(cu_k, cu)
        assert max_q == max_k == N and call["causal"] is True
        total = sum(lens)
        assert call["q"] == (total, 4, 8) and call["k"] == (total, 2, 8)
        assert _variants(call) == EXPECTED[kind][layer]
    if not right:   # left padding matters: without the mask the logits move
        unmasked = _logits(model, NAME, ids)
        assert (unmasked[real] - eager[real]).abs().max() > 1e3 * TOL["atol"]


@pytest.mark.parametrize("kind", MODELS)
def test_batched_greedy_generation_with_left_padding_matches_eager(kind,
                                                                   calls):
    model = _model(kind)
    ids, mask = _padded()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False,
              pad_token_id=0)
    tokens = {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(ids, **kw)
    assert tokens[NAME].shape == (3, N + 6)
    assert torch.equal(tokens[NAME], tokens["eager"])
    # prefill and every step (one query per sequence against a cache padded
    # on the left) in flashlib.attention_varlen; but a sliding layer's steps
    # see the last W positions only, all real here (every sequence is longer
    # than W): no padding left, flashlib.decode on its cache of W keys
    assert len(calls) == 2 * 6
    lens = torch.tensor([N - 5, N, N - 11])
    assert lens.min() > W
    for step, call in enumerate(calls):
        layer, new = step % 2, step // 2
        assert _variants(call) == EXPECTED[kind][layer]
        if "window_size" in call and new > 0:
            assert call["fn"] == "decode" and call["k"][2] == W
            continue
        assert call["fn"] == "attention_varlen"
        cu_q, cu_k, max_q, max_k = call["args"]
        want_q = lens if new == 0 else torch.ones(3, dtype=torch.long)
        want_k = lens + new                 # the prompt and the new tokens
        assert torch.equal(cu_q.diff().long(), want_q)
        assert torch.equal(cu_k.diff().long(), want_k)
        assert (max_q, max_k) == (int(want_q.max()), int(want_k.max()))


@pytest.mark.parametrize("kind", ["mistral", "gpt_oss"])
def test_padded_generation_gives_each_sequence_its_own_tokens(kind, calls):
    """Left padding changes nothing: each sequence of the padded batch gets
    eager's tokens and the tokens it gets alone, unpadded. Sequence 2 has 3
    tokens, fewer than the window: the sliding layers' steps see padding in
    their cache of W positions too (attention_varlen, not decode)."""
    model = _model(kind)
    ids, mask = _padded(pads=((0, 5), (2, N - 3)))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model.generate(ids, attention_mask=mask, **kw)
        model.set_attn_implementation(NAME)
        batched = model.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(batched, eager)
        sliding = [c for c in calls if "window_size" in c]
        assert sliding and sliding[0]["fn"] == "attention_varlen"
        assert any(c["fn"] == "attention_varlen" and c["q"][0] == 3
                   for c in sliding[1:])          # a step, padding cached
        for b in range(3):
            alone = ids[b:b + 1, mask[b].bool()]
            got = model.generate(alone, attention_mask=torch.ones_like(alone),
                                 **kw)
            assert torch.equal(got[0, -6:], batched[b, -6:]), b


def test_training_on_a_padded_batch_gives_eager_gradients():
    model, (ids, mask) = _model("gpt_oss"), _padded(right=True)
    labels = ids.masked_fill(mask == 0, -100)       # padding is not learned
    model.train()
    grads = {}
    for impl in ("eager", NAME):
        model.zero_grad()
        model.set_attn_implementation(impl)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    assert grads[NAME].keys() == grads["eager"].keys()
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads[NAME][n], g, rtol=1e-4, atol=1e-5,
                                   msg=n)


def test_a_hole_in_a_sequence_is_taken_without_a_window_refused_with_one():
    """Padding inside a sequence (a 0 between tokens): causal attention with
    no window closes the hole up exactly as eager masks it; a sliding window
    counts positions, so a hole would move it, and is refused."""
    ids, mask = _padded()
    mask[1, 7:9] = 0
    llama = _model("llama")
    eager = _logits(llama, "eager", ids, attention_mask=mask)
    ours = _logits(llama, NAME, ids, attention_mask=mask)
    torch.testing.assert_close(ours[mask.bool()], eager[mask.bool()], **TOL)
    mistral = _model("mistral")
    mistral.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match="sequence 1's tokens have a hole"):
        with torch.no_grad():
            mistral(ids, attention_mask=mask)


def test_dense_masks_are_accepted_only_as_the_plain_band(calls):
    model, ids = _model("llama"), _ids()
    eager = _logits(model, "eager", ids)
    band = torch.ones(N, N, dtype=torch.bool).tril()[None, None]
    low = torch.finfo(torch.float32).min
    additive = torch.zeros(N, N).masked_fill(~band[0, 0], low)[None, None]
    for mask in (band.expand(2, 1, N, N), additive):
        torch.testing.assert_close(
            _logits(model, NAME, ids, attention_mask=mask), eager, **TOL)
    padded = band.clone().expand(2, 1, N, N).clone()
    padded[1, :, :, 0] = False                    # key 0 of sequence 1
    bias = additive - 0.5 * band                  # not 0 / -inf: a bias
    model.set_attn_implementation(NAME)
    with torch.no_grad():
        with pytest.raises(ValueError, match="pass a padded batch's 2-D"):
            model(ids, attention_mask=padded)
        with pytest.raises(ValueError, match="adds a bias"):
            model(ids, attention_mask=bias)


def test_masks_flashlib_cannot_express_are_refused():
    model, ids = _model("llama"), _ids(n=12)
    model.set_attn_implementation(NAME)
    packed = torch.arange(6).repeat(2)[None]      # two sequences of 6
    with pytest.raises(ValueError, match="packed sequences"):
        with torch.no_grad():
            model(ids, position_ids=packed, use_cache=False)
    geometry = dict(batch_size=1, q_length=1, kv_length=16)
    with pytest.raises(ValueError, match="static cache"):
        hf.check_mask(**geometry, q_offset=3,
                      mask_function=mu.causal_mask_function)
    for fn in (mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=int)),
               mu.or_masks(mu.causal_mask_function,
                           mu.sliding_window_overlay(3)),
               lambda b, h, q, kv: kv <= q):
        with pytest.raises(ValueError, match="causal, bidirectional and"):
            hf.check_mask(**geometry, q_offset=15, mask_function=fn)
    short = torch.ones(1, 15, dtype=torch.bool)   # shorter than the keys
    with pytest.raises(ValueError, match="covers 15 positions, but the keys"):
        hf.check_mask(**geometry, q_offset=15, attention_mask=short,
                      mask_function=mu.causal_mask_function)
    with pytest.raises(ValueError, match=r"expected a 2-D \(1, total length"):
        hf.check_mask(**geometry, q_offset=15, attention_mask=short[None],
                      mask_function=mu.causal_mask_function)
    holed = torch.ones(1, 16, dtype=torch.bool)
    holed[0, 12] = False
    with pytest.raises(ValueError, match="sequence 0's tokens have a hole"):
        hf.check_mask(**geometry, q_offset=15, attention_mask=holed,
                      mask_function=mu.sliding_window_causal_mask_function(8))


def test_check_mask_returns_the_band():
    geometry = dict(batch_size=2, q_length=5, kv_length=9, q_offset=4)
    ones = torch.ones(2, 9, dtype=torch.bool)
    cases = [(mu.causal_mask_function, hf.Band(True)),
             (mu.bidirectional_mask_function, hf.Band(False)),
             (mu.sliding_window_causal_mask_function(4), hf.Band(True, 4)),
             (mu.sliding_window_bidirectional_mask_function(2),
              hf.Band(False, 2))]
    for fn, band in cases:
        assert hf.check_mask(**geometry, mask_function=fn,
                             attention_mask=ones) == band
    # a sliding layer's cache: the keys start later, still end at the query
    assert hf.check_mask(batch_size=1, q_length=1, kv_length=6, q_offset=30,
                         kv_offset=25,
                         mask_function=mu.causal_mask_function) == hf.Band(
                             True)
    # cross-attention: keys of another length, no alignment needed
    assert hf.check_mask(batch_size=1, q_length=3, kv_length=7,
                         mask_function=mu.bidirectional_mask_function) == (
                             hf.Band(False))
    # padding: the Band carries where the real tokens are (varlen's rows)
    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    band = hf.check_mask(**geometry, mask_function=mu.causal_mask_function,
                         attention_mask=left)
    assert band != hf.Band(True) and band.causal
    assert band.sliding_window is None
    pad = band.padding
    assert pad.cu_seqlens_q.tolist() == [0, 5, 10]            # 5 queries each
    assert pad.cu_seqlens_k.tolist() == [0, 7, 16]            # 7 and 9 keys
    assert pad.cu_seqlens_q.dtype == pad.cu_seqlens_k.dtype == torch.int32
    assert (pad.max_seqlen_q, pad.max_seqlen_k) == (5, 9)
    assert (pad.q_length, pad.kv_length) == (5, 9)
    assert pad.q_index.tolist() == list(range(10))
    assert pad.k_index.tolist() == list(range(2, 18))
    # a sliding layer's keys start later: only their part of the mask counts
    band = hf.check_mask(batch_size=2, q_length=1, kv_length=4, q_offset=8,
                         kv_offset=5, attention_mask=left,
                         mask_function=mu.sliding_window_causal_mask_function(
                             4))
    assert band.padding is None and band == hf.Band(True, 4)
    assert hf.Band(True, 4).window_size == (3, 0)
    assert hf.Band(False, 4).window_size == (4, 4)
    assert hf.Band(True).window_size == (-1, -1)


def test_the_mask_decides_causality_as_for_eager():
    """Gemma 2's use_bidirectional_attention makes its layers say
    is_causal=False, yet transformers still builds causal masks: eager
    attention is causal, and so is flashlib.hf (the Band decides)."""
    model, ids = _model("gemma2", use_bidirectional_attention=True), _ids()
    assert model.model.layers[0].self_attn.is_causal is False
    torch.testing.assert_close(_logits(model, NAME, ids),
                               _logits(model, "eager", ids), **TOL)


def test_training_gradients_match_eager_sinks_included():
    model, ids = _model("gpt_oss"), _ids()
    model.train()
    grads = {}
    for impl in ("eager", NAME):
        model.zero_grad()
        model.set_attn_implementation(impl)
        model(ids, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    assert grads[NAME].keys() == grads["eager"].keys()
    assert any(n.endswith("sinks") for n in grads[NAME])
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads[NAME][n], g, rtol=1e-4, atol=1e-5,
                                   msg=n)


def test_dropout_reaches_flashlib_and_torch_seed_reproduces_it(calls):
    model, ids = _model("llama", attention_dropout=0.25), _ids()
    model.set_attn_implementation(NAME)
    model.train()
    losses = []
    for _ in range(2):
        torch.manual_seed(7)
        losses.append(model(ids, labels=ids).loss)
    torch.manual_seed(8)
    other = model(ids, labels=ids).loss
    assert [c.get("dropout_p") for c in calls] == [0.25] * 6
    assert losses[0].item() == losses[1].item() != other.item()
    model.eval()                     # transformers passes 0.0: no dropout
    calls.clear()
    _logits(model, NAME, ids)
    assert all("dropout_p" not in c for c in calls)


def test_attention_forward_layout_and_refusals():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = (torch.randn(2, 2, 9, 8, generator=g) for _ in range(2))
    sinks = torch.randn(4, generator=g)
    layer = torch.nn.Module()
    layer.is_causal = True
    o, weights = hf.attention_forward(layer, q, k, v, None, scaling=0.3,
                                      sliding_window=3, softcap=4.0,
                                      s_aux=sinks, backend="reference")
    want, _ = reference_gqa(q, k, v, causal=True, scale=0.3,
                            window_size=(2, 0), softcap=4.0,
                            sinks=sinks.numpy())
    assert weights is None and o.shape == (2, 5, 4, 8) and o.is_contiguous()
    torch.testing.assert_close(o, torch.from_numpy(want).float()
                               .transpose(1, 2), **TOL)
    # one query: a generation step, computed by flashlib.decode
    o1, _ = hf.attention_forward(layer, q[:, :, -1:], k, v, None, scaling=0.3,
                                 sliding_window=3, softcap=4.0, s_aux=sinks,
                                 backend="reference")
    torch.testing.assert_close(o1, o[:, -1:], **TOL)
    # a 2-D padding mask (1 = token): varlen on the real rows, padding rows 0
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :6] = 0                     # sequence 0: 3 keys, its last 3 queries
    op, _ = hf.attention_forward(layer, q, k, v, pad, scaling=0.3,
                                 sliding_window=3, softcap=4.0, s_aux=sinks,
                                 backend="reference")
    assert op.shape == (2, 5, 4, 8)
    torch.testing.assert_close(op[1], o[1], **TOL)
    assert not op[0, :2].any()
    want0, _ = reference_gqa(q[:1, :, 2:], k[:1, :, 6:], v[:1, :, 6:],
                             causal=True, scale=0.3, window_size=(2, 0),
                             softcap=4.0, sinks=sinks.numpy())
    torch.testing.assert_close(op[0, 2:], torch.from_numpy(want0).float()[0]
                               .transpose(0, 1), **TOL)
    with pytest.raises(ValueError, match=r"expected a \(2, 9\) padding"):
        hf.attention_forward(layer, q, k, v, pad[:, 1:])
    with pytest.raises(ValueError, match="packed sequences"):
        hf.attention_forward(layer, q, k, v, None,
                             cu_seq_lens_q=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="position_bias"):
        hf.attention_forward(layer, q, k, v, None,
                             position_bias=torch.zeros(1))


def test_flashlib_arguments_maps_what_transformers_passes():
    layer = torch.nn.Module()
    q = torch.zeros(1, 4, 3, 8)
    args = hf.flashlib_arguments(layer, q, scaling=0.5, sliding_window=4,
                                 softcap=50.0, dropout=0.1,
                                 s_aux=torch.zeros(4, dtype=torch.bfloat16))
    sinks = args.pop("sinks")
    assert sinks.dtype == torch.float32 and sinks.shape == (4,)
    assert args == {"causal": True, "scale": 0.5, "window_size": (3, 0),
                    "softcap": 50.0, "dropout_p": 0.1}
    assert hf.flashlib_arguments(layer, q, sliding_window=4,
                                 is_causal=False) == {
        "causal": False, "scale": None, "window_size": (4, 4)}
    assert hf.flashlib_arguments(layer, q, softcap=0.0, dropout=0.0) == {
        "causal": True, "scale": None}
    layer.is_causal = False
    assert hf.flashlib_arguments(layer, q)["causal"] is False
    with pytest.raises(ValueError, match="s_aux"):
        hf.flashlib_arguments(layer, q, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="sliding_window"):
        hf.flashlib_arguments(layer, q, sliding_window=0)
    with pytest.raises(TypeError, match="sliding_window"):
        hf.flashlib_arguments(layer, q, sliding_window=True)


def test_register_is_idempotent_and_checks_the_name():
    assert hf.register(NAME, backend="reference") == NAME
    first = AttentionInterface._global_mapping[NAME]
    assert hf.register(NAME, backend="reference") == NAME
    assert AttentionInterface._global_mapping[NAME] is first
    assert first.keywords == {"backend": "reference"}
    assert mu.AttentionMaskInterface._global_mapping[NAME] is hf.check_mask
    assert hf.register() == "FlashLib"
    assert AttentionInterface._global_mapping["FlashLib"].keywords == {
        "backend": "auto"}
    for bad in ("flashlib", "my_flash", "sdpa", "eager", ""):
        with pytest.raises(ValueError, match="name"):
            hf.register(bad)
    with pytest.raises(TypeError):
        hf.register(name=3)
    with pytest.raises(TypeError):
        hf.register(backend=None)


def test_why_the_name_avoids_flash():
    """transformers takes any implementation name containing "flash" for a
    flash-attn kernel to load: "flashlib" would fail in set_attn_implementation
    (if this starts passing, transformers changed, and "flashlib" could be
    the name)."""
    AttentionInterface.register("flashprobe", hf.attention_forward)
    model = _model("llama")
    try:
        with pytest.raises((ValueError, ImportError)):
            model.set_attn_implementation("flashprobe")
    finally:
        AttentionInterface._global_mapping.pop("flashprobe")


def test_tiny_model_builds_each_family_small_and_seeded():
    assert all(opts.get("sliding_window", W) == W
               for _, _, opts in hf.TINY_MODELS.values())
    for kind in MODELS:
        model = hf.tiny_model(kind)
        assert not model.training and model.config.num_hidden_layers == 2
        assert sum(p.numel() for p in model.parameters()) < 100_000
    a, b = hf.tiny_model("llama"), hf.tiny_model("llama")
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    other = hf.tiny_model("llama", seed=1, num_hidden_layers=3)
    assert other.config.num_hidden_layers == 3
    assert not torch.equal(a.lm_head.weight, other.lm_head.weight)
    with pytest.raises(ValueError, match="kind"):
        hf.tiny_model("bert")


def test_a_band_built_for_other_sizes_is_refused():
    """A layer whose sizes are not those its mask was built for (a model that
    would hand one layer another layer's mask) gets an error, not a wrong
    unpadding."""
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :4] = 0
    band = hf.check_mask(batch_size=2, q_length=9, kv_length=9,
                         mask_function=mu.causal_mask_function,
                         attention_mask=mask)
    layer = torch.nn.Module()
    q = torch.zeros(2, 4, 9, 8)
    k = torch.zeros(2, 2, 7, 8)
    with pytest.raises(ValueError, match="built for 2 sequences of 9 queries "
                                         "and 9 keys, but this layer has 2 "
                                         "sequences, 9 queries and 7 keys"):
        hf.attention_forward(layer, q, k, k, band, backend="reference")
