"""flashlib.testing: the shared checker (the oracle itself is exercised by every algorithm test)."""
import numpy as np
import pytest

from flashlib.testing import assert_close, max_error


def test_checker_catches_errors_nan_and_infinity_mismatch():
    assert_close([1.0, -np.inf], [1.0, -np.inf])
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close([1.0, 2.0], [1.0, 2.1], atol=1e-3, rtol=0)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close([np.nan], [0.0])
    with pytest.raises(AssertionError, match="infinity mismatch"):
        assert_close([0.0], [-np.inf])
    assert max_error([1.0, -np.inf], [1.5, -np.inf]) == 0.5
    assert max_error([np.nan], [0.0]) == float("inf")


def test_rounding_floor_is_flash_attns_slack_worked_by_hand():
    """0 in bfloat16: 0 + 0.3 rounds to 0.30078125 (154/128 * 2^-2); minus 0.3 is 7.8124e-4, which rounds
    to 205/128 * 2^-11; twice that. The slack grows with the values' magnitude, and fp16 (11 bits) has
    less than bf16 (8 bits)."""
    import torch

    from flashlib.testing import ROUNDING, assert_fa_rule, rounding_floor
    assert rounding_floor(np.zeros(3), torch.bfloat16) == 2 * 205 / 128 * 2.0 ** -11
    small, big = np.linspace(0, 0.5, 1000), np.linspace(0, 4, 1000)
    assert rounding_floor(small, torch.bfloat16) < rounding_floor(big, torch.bfloat16)
    assert rounding_floor(big, torch.float16) < rounding_floor(big, torch.bfloat16)
    want = np.zeros(4)
    off = torch.full((4,), 1e-3, dtype=torch.bfloat16)              # 1e-3 off, where plain torch is exact
    with pytest.raises(AssertionError):
        assert_fa_rule(off, torch.zeros(4, dtype=torch.bfloat16), want)
    assert_fa_rule(off, torch.zeros(4, dtype=torch.bfloat16), want, floor=ROUNDING)   # within 1.56e-3
    with pytest.raises(ValueError, match="floor must be a number or 'rounding', got 'loose'"):
        assert_fa_rule(off, off, want, floor="loose")
    for bad in ("bfloat16", torch.int32):
        with pytest.raises(TypeError, match="rounding_floor: dtype must be a torch floating dtype"):
            rounding_floor(want, bad)
