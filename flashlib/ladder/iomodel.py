"""A counted memory model: HBM bytes read and written, on-chip working set, and
operation counts.

Every ladder algorithm reports each tile it loads from or stores to HBM to an
:class:`IOCounter` while it runs, so the traffic a chapter plots is *measured
from the algorithm*, not typed in from a formula. The model is the one of the
FlashAttention paper (Dao et al. 2022, Section 3.2): a slow, large HBM and a
fast on-chip SRAM of ``M`` elements; an algorithm's cost is the number of
elements that cross between them. Leading dims (batch, heads) are independent
problems, each on its own streaming multiprocessor, so the on-chip working set
of a step is counted *per problem* (the last two dims of each tile).

Explained in: notebooks/01_naive_attention (traffic) and
notebooks/03_flashattention1 (SRAM budget).
"""
from __future__ import annotations

import numpy as np

from ..validation import check_block, check_count

__all__ = ["IOCounter", "SRAMOverflowError", "traffic_slope"]


class SRAMOverflowError(ValueError):
    """A step of an algorithm needs more on-chip memory than the counter's
    ``sram_bytes``.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/ladder/test_iomodel.py.
    """


def _tile(tile, name: str) -> np.ndarray:
    """A tile: a NumPy array of numbers or bools (or what ``np.asarray`` makes
    one of)."""
    is_torch = type(tile).__module__.startswith("torch")
    array = np.asarray(tile) if not is_torch else None
    if array is None or array.dtype.kind not in "biuf":
        raise TypeError(
            f"{name} must be a NumPy array of numbers, "
            f"got {type(tile).__name__}"
            + ("" if array is None else f" of dtype {array.dtype}"))
    return array


def _elements_per_problem(tile: np.ndarray) -> int:
    # Tiles are (..., rows, cols); leading dims are independent problems on
    # different SMs.
    if tile.ndim == 0:
        return 1
    if tile.ndim == 1:
        return tile.shape[-1]
    return tile.shape[-2] * tile.shape[-1]


class IOCounter:
    """Counts HBM traffic (bytes) and checks the on-chip working set of every
    step.

    Args:
        bytes_per_element: size of one element in HBM (2 for fp16/bf16, 4 for
            fp32). The count models a kernel storing tensors in that format,
            whatever dtype NumPy computes in. Row statistics (m, l, LSE, D) are
            counted at the same size; real kernels keep them in fp32, a
            difference of O(N) bytes next to the O(Nd) and O(N^2) terms.
        sram_bytes: on-chip memory of one SM available to one problem; ``None``
            means unlimited.

    Attributes:
        hbm_read_bytes, hbm_write_bytes: bytes loaded from / stored to HBM so
            far.
        peak_sram_bytes: the largest working set any step reported.
        matmul_flops, other_flops: operation counts the algorithms report
            (matmul vs the rest: exp, max, rescaling, division), for the
            FA1-vs-FA2 comparison.
        tiles: the ``(i, j)`` tiles processed, in order: ``i`` the first query
            and ``j`` the first key of the tile (FA2's forward and backward
            report each tile they do not skip).

    Explained in: notebooks/01_naive_attention.

    Tested in: tests/ladder/test_iomodel.py.
    """

    def __init__(self, bytes_per_element: int = 2,
                 sram_bytes: int | None = None):
        self.bytes_per_element = check_block(bytes_per_element,
                                             "bytes_per_element")
        self.sram_bytes = (None if sram_bytes is None
                           else check_block(sram_bytes, "sram_bytes"))
        self.reset()

    def reset(self) -> None:
        """Zero every count."""
        self.hbm_read_bytes = 0
        self.hbm_write_bytes = 0
        self.peak_sram_bytes = 0
        self.matmul_flops = 0
        self.other_flops = 0
        self.tiles = []

    @property
    def hbm_bytes(self) -> int:
        """Reads plus writes."""
        return self.hbm_read_bytes + self.hbm_write_bytes

    def load(self, tile: np.ndarray) -> np.ndarray:
        """Count ``tile`` as read from HBM and return it (a copy: it now lives
        on chip)."""
        tile = _tile(tile, "tile")
        self.hbm_read_bytes += tile.size * self.bytes_per_element
        return np.array(tile, copy=True)

    def store(self, dst: np.ndarray, index, tile) -> None:
        """Write ``tile`` to ``dst[index]`` in HBM and count the bytes
        written."""
        if not isinstance(dst, np.ndarray):
            raise TypeError("dst must be a NumPy array (the HBM buffer), "
                            f"got {type(dst).__name__}")
        dst[index] = tile
        written = np.asarray(dst[index]).size
        self.hbm_write_bytes += written * self.bytes_per_element

    def sram(self, *tiles: np.ndarray, limit: int | None = None) -> int:
        """Report the tiles resident on chip during one step; raise if they
        exceed the budget.

        The budget is ``sram_bytes``, or ``limit`` (an algorithm's own
        ``sram_bytes`` argument) when that is smaller. Returns the working set
        in bytes for one problem (one batch element, head).
        """
        limit = None if limit is None else check_block(limit, "limit")
        elements = sum(_elements_per_problem(_tile(t, "tiles")) for t in tiles)
        used = elements * self.bytes_per_element
        self.peak_sram_bytes = max(self.peak_sram_bytes, used)
        budget = min((b for b in (self.sram_bytes, limit) if b is not None),
                     default=None)
        if budget is not None and used > budget:
            shapes = ", ".join(str(tuple(t.shape[-2:])) for t in tiles)
            raise SRAMOverflowError(
                f"a step needs {used} bytes on chip (tiles {shapes} at "
                f"{self.bytes_per_element} B per element), more than "
                f"sram_bytes={budget}; use smaller blocks")
        return used

    def flops(self, matmul: int = 0, other: int = 0) -> None:
        """Count operations: ``matmul`` (multiply-adds count 2) and ``other``
        (exp, max, scale, divide)."""
        self.matmul_flops += check_count(matmul, "matmul")
        self.other_flops += check_count(other, "other")

    def tile(self, i: int, j: int) -> None:
        """Record that the tile of queries from ``i`` and keys from ``j`` was
        processed (not skipped)."""
        self.tiles.append((check_count(i, "i"), check_count(j, "j")))

    def __repr__(self) -> str:
        return (f"IOCounter(read={self.hbm_read_bytes:,} B, "
                f"write={self.hbm_write_bytes:,} B, "
                f"peak_sram={self.peak_sram_bytes:,} B)")


def traffic_slope(algorithm, ns, *, d: int = 16, bytes_per_element: int = 2,
                  **kwargs):
    """Measure how an algorithm's HBM traffic grows with the sequence length.

    Runs ``algorithm(x, x, x, io=..., **kwargs)`` (e.g.
    :func:`flashlib.ladder.fa2.forward`; one head, ``Nq = Nk = N``, head dim
    ``d``) for each ``N`` in ``ns``, counts its HBM bytes, and fits
    ``log(bytes) = slope * log(N) + c`` by least squares. FA2 with a sliding
    window of fixed width W gives a slope near 1 (traffic O(N W)); dense or
    causal attention near 2 (O(N^2 d / M)).

    Args:
        algorithm: a ladder function taking ``(q, k, v, io=...)``.
        ns: at least two distinct sequence lengths (ints >= 1).
        d: head dim; bytes_per_element: as for :class:`IOCounter`.
        kwargs: passed to ``algorithm`` (``causal``, ``window_size``,
            ``block_q``, ``block_k``...).

    Returns:
        ``(slope, hbm_bytes)``: the fitted slope (a float) and the bytes
        counted for each N (a list of ints).

    Explained in: notebooks/09_real_models.
    Tested in: tests/ladder/test_iomodel.py.
    """
    if not callable(algorithm):
        raise TypeError(f"algorithm must be a ladder function, got "
                        f"{type(algorithm).__name__}")
    ns = [check_block(n, "ns") for n in _as_list(ns, "ns")]
    if len(set(ns)) < 2:
        raise ValueError(f"ns must hold at least two distinct lengths, "
                         f"got {ns}")
    d = check_block(d, "d")
    hbm_bytes = []
    for n in ns:
        io = IOCounter(bytes_per_element)
        x = np.zeros((n, d), dtype=np.float32)
        algorithm(x, x, x, io=io, **kwargs)
        hbm_bytes.append(io.hbm_bytes)
    slope = np.polyfit(np.log(ns), np.log(hbm_bytes), 1)[0]
    return float(slope), hbm_bytes


def _as_list(xs, name: str) -> list:
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, "
                        f"got {type(xs).__name__}")
    return list(xs)
