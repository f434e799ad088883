"""hardware, measure, display and testing helpers."""
import numpy as np
import pytest

import flashlib
from flashlib import hardware, measure
from flashlib.testing import assert_close, max_error


def test_hardware_table_and_ridge_points():
    t4 = hardware.get("T4")
    assert (t4.arch, t4.sms, t4.smem_per_block_kb) == ("sm_75", 40, 64)
    assert t4.ridge_flops_per_byte == pytest.approx(65e12 / 320e9)
    assert hardware.get("H100-SXM").ridge_flops_per_byte > hardware.get("A100-80GB").ridge_flops_per_byte
    assert set(hardware.ARCH_SMEM_LIMIT) == {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90"}
    with pytest.raises(ValueError, match="name must be one of"):
        hardware.get("V100")


def test_peak_memory_sees_an_n_by_n_matrix():
    _, peak = measure.peak_memory(lambda n: np.ones((n, n)), 512)
    assert 512 * 512 * 8 <= peak < 2 * 512 * 512 * 8
    _, small = measure.peak_memory(lambda n: np.ones(n), 512)
    assert small < 10_000
    with pytest.raises(TypeError, match="fn must be callable"):
        measure.peak_memory(3)


def test_best_time():
    assert measure.best_time(sum, range(1000), repeat=2) > 0
    with pytest.raises(ValueError, match="repeat must be a positive int"):
        measure.best_time(sum, [], repeat=0)


def test_show_returns_the_library_source():
    code = flashlib.show(flashlib.fa2.forward)
    assert "def forward(" in code.data and "line 12" in code.data
    with pytest.raises(TypeError, match="obj must be a function"):
        flashlib.show(3)


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
