"""Property test of flashlib/kernels/triton/decode_v3.py (hypothesis), in its own file so that the example
tests of test_triton_decode_v3.py still run on a Python without hypothesis (make test-gpu PY=python3)."""
from __future__ import annotations

import torch
from conftest import DEVICE, need_module
from test_triton_decode_v3 import decode_oracle
from triton_cases import make_qkv

import flashlib
from flashlib.testing import assert_close

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 3), heads=st.sampled_from([(1, 1), (4, 2), (6, 1), (8, 8)]), nq=st.integers(1, 3),
       nmax=st.integers(1, 200), d=st.sampled_from([8, 16, 40, 64]), num_splits=st.integers(1, 6),
       lengths=st.one_of(st.none(), st.lists(st.integers(0, 200), min_size=3, max_size=3)),
       seed=st.integers(0, 2**16))
def test_property_decode_matches_the_oracle(b, heads, nq, nmax, d, num_splits, lengths, seed):
    """Any batch, GQA group, query count, cache length, head dim and split count (one split: no combine
    launch, the split kernel writes o and lse itself), with no lengths (every key valid) or ragged ones
    including empty sequences: float32 within 2e-5 of the float64 oracle."""
    q, kc, vc, _ = make_qkv(b, heads[0], heads[1], nq, nmax, d, seed=seed, device=DEVICE)
    lens = None if lengths is None else torch.tensor([min(n, nmax) for n in lengths[:b]], device=DEVICE)
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend="triton")
    ro, rl = decode_oracle(q, kc, vc, torch.full((b,), nmax) if lens is None else lens)
    assert_close(o, ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, rl, atol=2e-5, rtol=2e-5, name="lse")
