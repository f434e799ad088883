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
