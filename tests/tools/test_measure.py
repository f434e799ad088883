"""flashlib.tools.measure: tracemalloc peak memory and best-of timing."""
import numpy as np
import pytest

from flashlib.tools import measure


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
