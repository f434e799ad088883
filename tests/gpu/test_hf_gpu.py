"""GPU tier: transformers models run their attention in flashlib's compiled Triton kernels (flashlib.hf).

The CPU suite (tests/test_hf.py) checks the mapping from transformers' arguments to flashlib's on the
float64-capable "reference" backend. Here the same tiny models (Llama, Mistral with a sliding window,
Gemma 2 with softcapping, gpt-oss with sinks) run on a CUDA GPU through backend "triton": prefill in
flashlib.attention, token-by-token steps in flashlib.decode, padded batches (left padding in batched
generation) in flashlib.attention_varlen. fp32 logits against transformers' eager attention on the same
GPU (on the real tokens of a padded batch), and identical greedy tokens; half precision under
FlashAttention's rule against eager in the same dtype (eager in float32 as the reference).
"""
from __future__ import annotations

import pytest
import torch

from conftest import need_module

need_module("transformers")   # under FLASHLIB_REQUIRE_ALL (make test-gpu) a missing transformers fails
from flashlib import hf  # noqa: E402

DEVICE = torch.device("cuda")
NAME = "FlashLibGpu"


@pytest.fixture(autouse=True, scope="module")
def registered():
    """flashlib in transformers' registries, on the Triton kernels (when the tests run, not when the
    tier is collected: collecting must import nothing of transformers')."""
    hf.register(NAME, backend="triton")


def _logits(model, impl, ids):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("kind", list(hf.TINY_MODELS))
def test_fp32_logits_and_greedy_tokens_match_eager(kind):
    model = hf.tiny_model(kind).to(DEVICE)
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    eager = _logits(model, "eager", ids)
    ours = _logits(model, NAME, ids)
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
    tokens = {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens[NAME], tokens["eager"])


@pytest.mark.parametrize("kind", list(hf.TINY_MODELS))
def test_half_precision_logits_follow_the_flashattention_rule(kind):
    dtype = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    model = hf.tiny_model(kind).to(DEVICE)
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    exact = _logits(model, "eager", ids)                         # float32 eager: the reference
    model = model.to(dtype)
    base = (_logits(model, "eager", ids) - exact).abs().max()
    ours = (_logits(model, NAME, ids) - exact).abs().max()
    assert ours <= 2 * base + 1e-3, f"flashlib {ours:.3e} against eager {base:.3e} in {dtype}"


def _left_padded(batch=3, n=40, seed=3):
    """Ids and a 2-D mask with left padding: 7 padding tokens in sequence 0, 35 in sequence 2 (5 real
    tokens, fewer than the tiny models' window of 6: the sliding layers' caches hold padding too), none in
    sequence 1."""
    ids = torch.randint(3, 100, (batch, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[2, :35] = 0
    return ids.masked_fill(mask == 0, 0).to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("kind", list(hf.TINY_MODELS))
def test_left_padded_batch_logits_and_greedy_tokens_match_eager(kind):
    """Batched generation with left padding: the prompt and every step through flashlib.attention_varlen
    on the compiled kernels (the steps one query per sequence against a cache padded on the left)."""
    model = hf.tiny_model(kind).to(DEVICE)
    ids, mask = _left_padded()
    logits, tokens = {}, {}
    for impl in ("eager", NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=mask).logits.float()
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                          pad_token_id=0)
    real = mask.bool()
    torch.testing.assert_close(logits[NAME][real], logits["eager"][real], rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens[NAME], tokens["eager"])
