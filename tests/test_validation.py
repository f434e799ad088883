"""flashlib.validation: the one validator of the torch-facing arguments, and who uses it.

The messages as flashlib.attention / decode show them are checked in tests/test_api.py; here, the
checks themselves and that the API, the CUDA kernels' entry points, ring attention and the ladder
share them rather than keeping copies.
"""
import numpy as np
import pytest
import torch

from flashlib import api, validation
from flashlib.ladder import _checks
from flashlib.kernels import cuda
from flashlib.parallel import ring
from flashlib.validation import (MAX_HEAD_DIM, check_block, check_cache_seqlens, check_flag,
                                 check_num_splits, check_scale, check_tensors)


def _qkv(b=2, h=4, hkv=2, nq=3, nk=5, d=8, dtype=torch.float32):
    return torch.zeros(b, h, nq, d, dtype=dtype), *(torch.zeros(b, hkv, nk, d, dtype=dtype) for _ in "kv")


def test_check_tensors_accepts_gqa_and_names_the_offending_argument():
    q, k, v = _qkv()
    check_tensors(q, k, v)                                            # H = 4, Hkv = 2: fine
    with pytest.raises(TypeError, match=r"k_cache must be a torch\.Tensor, got ndarray \(for NumPy"):
        check_tensors(q, k.numpy(), v, k_name="k_cache", v_name="v_cache")
    with pytest.raises(ValueError, match=r"v_cache must have the shape of k_cache"):
        check_tensors(q, k, v[:, :, :2], k_name="k_cache", v_name="v_cache")
    with pytest.raises(ValueError, match=r"multiple of kv heads Hkv=3 \(the heads of k\)"):
        check_tensors(q, *_qkv(hkv=3)[1:])
    with pytest.raises(ValueError, match=rf"head dim must be between 1 and {MAX_HEAD_DIM}, got 257"):
        check_tensors(*_qkv(d=257))
    with pytest.raises(ValueError, match=r"k and v must hold at least one key"):
        check_tensors(*_qkv(nk=0))
    with pytest.raises(TypeError, match=r"v must have the dtype of q"):
        check_tensors(q, k, v.double())


@pytest.mark.parametrize("value,expected", [(None, 8 ** -0.5), (2, 2.0), (np.float32(0.5), 0.5)])
def test_check_scale_defaults_to_one_over_sqrt_d(value, expected):
    assert check_scale(value, 8) == pytest.approx(expected) and type(check_scale(value, 8)) is float


@pytest.mark.parametrize("value,exc", [(True, TypeError), ("0.1", TypeError), (float("inf"), ValueError),
                                       (float("nan"), ValueError)])
def test_check_scale_refuses(value, exc):
    with pytest.raises(exc, match="scale must be"):
        check_scale(value, 8)


def test_flags_blocks_and_splits():
    assert check_flag(False, "causal") is False
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        check_flag(1, "causal")
    assert check_block(None, "block_q", default=64) == 64 and check_block(np.int64(3), "block_q") == 3
    with pytest.raises(ValueError, match="block_q is required"):
        check_block(None, "block_q")
    assert check_num_splits(np.int32(4)) == 4
    with pytest.raises(TypeError, match="num_splits must be an int >= 1, got bool"):
        check_num_splits(True)
    with pytest.raises(ValueError, match="num_splits must be an int >= 1, got 0"):
        check_num_splits(0)


def test_check_cache_seqlens():
    q = torch.zeros(2, 1, 1, 4)
    lens = torch.tensor([0, 7], dtype=torch.int32)
    assert check_cache_seqlens(lens, q, 7) is lens
    with pytest.raises(TypeError, match="cache_seqlens must have dtype int32 or int64"):
        check_cache_seqlens(lens.to(torch.int16), q, 7)
    with pytest.raises(ValueError, match=r"must lie in \[0, 6\].*\[0, 7\]"):
        check_cache_seqlens(lens, q, 6)


def test_one_definition_shared_by_the_api_the_ladder_the_cuda_kernels_and_the_ring():
    assert _checks.check_scale is validation.check_scale and _checks.check_block is validation.check_block
    assert api.check_tensors is check_tensors and api.MAX_HEAD_DIM == MAX_HEAD_DIM
    q, k, v = _qkv(hkv=3)
    message = r"the number of query heads H=4 must be a multiple of kv heads Hkv=3 \(the heads of k\)"
    for call in (api.attention, cuda.forward, ring.ring_attention):  # refused before any kernel or group
        with pytest.raises(ValueError, match=message):
            call(q, k, v)
    with pytest.raises(TypeError, match="scale must be a real number or None, got str"):
        cuda.forward(*_qkv(), scale="1")
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 5\] \(Nmax of k_cache\)"):
        cuda.decode(*_qkv(), cache_seqlens=torch.tensor([5, 6]), num_splits=2)


def test_cache_seqlens_on_a_device_are_checked_without_reading_their_values():
    """Reading a GPU tensor's lengths back would synchronise (and break CUDA-graph capture): off the CPU
    only type, shape and device are checked. A meta tensor has no values at all, so a read would raise."""
    q = torch.empty(2, 4, 1, 16, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    assert check_cache_seqlens(lens, q, 10) is lens
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(2,\)"):
        check_cache_seqlens(torch.empty(3, dtype=torch.int32, device="meta"), q, 10)
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\]"):        # on the CPU they are read
        check_cache_seqlens(torch.tensor([3, 11]), torch.empty(2, 4, 1, 16), 10)


def test_flags_take_numpy_bools_and_refuse_truthy_values():
    import numpy as np
    assert check_flag(np.bool_(True), "causal") is True and check_flag(np.bool_(False), "causal") is False
    for bad, kind in (("False", "str"), (2, "int"), (None, "NoneType"), (np.int64(1), "numpy.int64")):
        with pytest.raises(TypeError, match=f"causal must be a bool, got {kind}"):
            check_flag(bad, "causal")


def test_check_window_takes_pairs_of_ints_from_minus_one():
    from flashlib.validation import check_window
    assert check_window((-1, 0)) == (-1, 0) and check_window([3, 7]) == (3, 7)
    with pytest.raises(ValueError, match="window_size entries must be an int >= -1"):
        check_window((-2, 0))
    with pytest.raises(TypeError, match="window_size"):
        check_window((True, 0))
    with pytest.raises(TypeError, match="window_size must be a pair"):
        check_window(4)


def test_check_variants_keeps_only_what_is_used_and_expands_the_slopes():
    import torch

    from flashlib.validation import check_variants
    q = torch.zeros(2, 3, 4, 8)
    assert check_variants(q) == {}
    assert check_variants(q, window_size=(-1, -1), softcap=0.0, dropout_p=0.0) == {}
    used = check_variants(q, window_size=(2, 0), softcap=30, alibi_slopes=torch.ones(3),
                          sinks=torch.zeros(3), dropout_p=0.1, dropout_seed=(5, 6))
    assert used["window_size"] == (2, 0) and used["softcap"] == 30.0 and used["dropout_seed"] == (5, 6)
    assert used["alibi_slopes"].shape == (2, 3) and used["alibi_slopes"].is_contiguous()
    with pytest.raises(ValueError, match="decode is inference"):
        check_variants(q, dropout_p=0.1, op="decode")


def test_dropout_seeds_are_drawn_from_torch_and_checked():
    import torch

    from flashlib.validation import check_dropout_seed, draw_dropout_seed
    torch.manual_seed(3)
    a = draw_dropout_seed()
    torch.manual_seed(3)
    assert check_dropout_seed(None) == a and a != draw_dropout_seed()
    assert check_dropout_seed((2 ** 63 - 1, 0)) == (2 ** 63 - 1, 0)
    with pytest.raises(ValueError, match="offset"):
        check_dropout_seed((0, 2 ** 40))
    with pytest.raises(TypeError, match="dropout_seed"):
        check_dropout_seed(7)
