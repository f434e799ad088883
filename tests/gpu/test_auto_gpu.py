"""GPU tier: flashlib.auto under a Hugging Face model's ``generate`` (issue 10).

A tiny Llama with GQA (8 query heads, 2 kv heads), randomly initialised from a config (nothing is
downloaded), built with ``attn_implementation="sdpa"``, generates greedily with and without
flashlib.auto. Its prefill is one SDPA call per layer with ``is_causal=True`` (to flashlib.attention);
each later token is one query per head against the KV cache with ``is_causal=False`` (decode-shaped:
to flashlib.decode). Checked: the same tokens, and every token-by-token call counted as a decode.
The time per generated token against plain SDPA (issue 10's goal: no worse than 1.1x) is a speed goal,
not a correctness check (a T4 misses it, a shared GPU makes it flaky): ``python -m flashlib bench
--generate`` measures and reports it (flashlib.tools.bench.generate_per_token; make bench-gpu).

transformers is needed (tests/conftest.py's need_module: a skip with the reason, a failure under
FLASHLIB_REQUIRE_ALL).
"""
from __future__ import annotations

import torch
from conftest import need_module

need_module("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import flashlib.auto as auto  # noqa: E402

DEVICE = torch.device("cuda")
LAYERS = 2


def tiny_llama(dtype, device=DEVICE, seed=0):
    """A randomly initialised Llama small enough to build in a blink, calling SDPA for attention."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def prompt(batch, length, device=DEVICE, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (batch, length), generator=g).to(device)   # (B, T); 0..2 are special


def generate(model, ids, new):
    """``new`` greedy tokens after ids (B, T): (B, T + new), never stopped early by an EOS."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)


def check_tokens_and_counts(device=DEVICE, batch=3, length=40, new=16):
    """Generation with auto is token-identical to plain SDPA, in float32 (the tokens of two correct
    implementations can part only at a near-tie of the argmax, and float32 leaves none here), and the
    routes are as decode_shaped says: the prefill to attention, each later token's calls to decode."""
    model, ids = tiny_llama(torch.float32, device), prompt(batch, length, device)
    plain = generate(model, ids, new)
    before = dict(auto.stats)
    with auto.enabled():
        routed = generate(model, ids, new)
    counted = {name: auto.stats[name] - before[name] for name in before}
    assert torch.equal(routed, plain)
    assert plain.shape == (batch, length + new)
    assert counted == {"routed": LAYERS * new, "decode": LAYERS * (new - 1), "fallback": 0}, counted


def test_generate_is_token_identical_and_decodes_token_by_token():
    check_tokens_and_counts()
