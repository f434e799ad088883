"""Figures of the hardware the kernels run on: the memory hierarchy of one GPU of
:data:`flashlib.hardware.GPUS`, and FlashAttention-3's warp-specialized,
ping-pong schedule on Hopper.

Explained in: book/gpu_memory and notebooks/07c_hopper.
Tested in: tests/figures/test_hardware.py.
"""
from __future__ import annotations

import numbers
import pathlib

from matplotlib.figure import Figure
from matplotlib.patches import Polygon, Rectangle

from .. import hardware as _hw
from ..validation import check_int
from ._base import COLORS, ROOT, to_svg

__all__ = ["MEMORY_FACTS", "REGISTERS_PER_SM_KB", "SMEM_BYTES_PER_CLOCK",
           "MEMORY_HIERARCHY_SVG", "memory_hierarchy", "write_memory_hierarchy",
           "fa3_schedule"]

# Published figures the GPU table of flashlib.hardware does not hold, per GPU:
# (device memory in GB, its kind, L2 cache in MB, boost clock in MHz). Sources:
# NVIDIA's datasheets and architecture whitepapers (T4 and L4 datasheets, the
# A100 "Ampere" and H100 "Hopper" whitepapers).
MEMORY_FACTS: dict[str, tuple[int, str, int, int]] = {
    "T4": (16, "GDDR6", 4, 1590),
    "L4": (24, "GDDR6", 48, 2040),
    "A100-40GB": (40, "HBM2", 40, 1410),
    "A100-80GB": (80, "HBM2e", 40, 1410),
    "H100-SXM": (80, "HBM3", 50, 1980),
}
# Every architecture of the table (sm_75 .. sm_90): 64 K 32-bit registers per
# SM, and shared memory of 32 banks of 4 bytes, 128 bytes per clock per SM
# (CUDA C++ Programming Guide, compute capabilities).
REGISTERS_PER_SM_KB = 256
SMEM_BYTES_PER_CLOCK = 128
MEMORY_HIERARCHY_SVG = pathlib.Path("book") / "_static" / "memory_hierarchy.svg"


def _size(kb: float) -> str:
    """A size in KB as KB, MB or GB (powers of 1024), two significant-ish digits."""
    for unit, scale in (("GB", 1024**2), ("MB", 1024), ("KB", 1)):
        if kb >= scale:
            value = kb / scale
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{kb:g} KB"


def _levels(gpu) -> list[tuple[str, str, str, str]]:
    """(level, size, bandwidth, note) from the top of the pyramid down."""
    mem_gb, kind, l2_mb, mhz = MEMORY_FACTS[gpu.name]
    smem_tbs = gpu.sms * SMEM_BYTES_PER_CLOCK * mhz * 1e6 / 1e12
    regs = gpu.sms * REGISTERS_PER_SM_KB
    smem = gpu.sms * gpu.smem_per_block_kb
    return [
        ("registers", f"{_size(regs)}",
         "read every cycle", f"{REGISTERS_PER_SM_KB} KB per SM"),
        ("shared memory (SRAM)", f"{_size(smem)}",
         f"~{smem_tbs:.0f} TB/s",
         f"{gpu.smem_per_block_kb} KB per SM x {gpu.sms} SMs"),
        ("L2 cache", f"{l2_mb} MB", "bandwidth not published",
         "shared by all SMs"),
        (f"{'HBM' if kind.startswith('HBM') else 'DRAM'} ({kind})",
         f"{mem_gb} GB", f"{gpu.bandwidth_gbs / 1000:.1f} TB/s",
         "off-chip: every tensor"),
    ]


def memory_hierarchy(gpu: str = "A100-80GB") -> Figure:
    """The memory hierarchy of ``gpu`` (a name of :data:`flashlib.hardware.GPUS`)
    as a pyramid, fastest and smallest at the top, like Figure 1 (left) of the
    FlashAttention paper (Dao et al. 2022): registers, shared memory (SRAM), the
    L2 cache and HBM, each with its size over the whole chip and its bandwidth.

    From flashlib.hardware: SM count, shared memory per SM (the block opt-in
    limit) and HBM bandwidth. From :data:`MEMORY_FACTS` (datasheets): device
    memory, L2 size and boost clock. Shared-memory bandwidth is computed as
    SMs x 128 bytes per clock x boost clock (19.5 TB/s on an A100, the paper's
    "19 TB/s"); 256 KB of registers per SM.

    Explained in: book/gpu_memory.
    Tested in: tests/figures/test_hardware.py.
    """
    gpu = _hw.get(gpu)                       # TypeError / ValueError naming it
    levels = _levels(gpu)
    fig = Figure(figsize=(7.4, 4.6))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 10), ax.set_ylim(-0.2, 5.2), ax.axis("off")
    ax.text(0.15, 4.95, f"Memory of one {gpu.name} ({gpu.arch}, {gpu.sms} SMs)",
            fontsize=14.5, fontweight="bold", va="center")
    n = len(levels)
    apex, base, half = 4.6, 0.0, 2.4         # the pyramid: apex x = 2.4
    colors = ("#f6c9a8", "#cfe3f3", "#e4dcef", "#f1ead9")
    for i, ((name, size, bw, note), color) in enumerate(zip(levels, colors)):
        top = apex - i * (apex - base) / n
        bottom = apex - (i + 1) * (apex - base) / n
        w_top = half * (apex - top) / (apex - base)
        w_bottom = half * (apex - bottom) / (apex - base)
        ax.add_patch(Polygon([(half - w_top, top), (half + w_top, top),
                              (half + w_bottom, bottom),
                              (half - w_bottom, bottom)],
                             closed=True, facecolor=color, edgecolor="0.3"))
        mid = (top + bottom) / 2
        ax.text(half, mid - 0.12 if i == 0 else mid, name if i else "regs",
                ha="center", va="center", fontsize=11.5 if i else 10)
        ax.plot([half + (w_top + w_bottom) / 2 + 0.1, 4.85], [mid, mid],
                color="0.6", lw=0.8)
        ax.text(4.95, mid + 0.19, f"{name}: {size}", fontsize=13,
                fontweight="bold", va="center")
        ax.text(4.95, mid - 0.21, f"{bw} · {note}", fontsize=11.5,
                va="center", color="0.25")
    ax.annotate("", xy=(0.1, 4.4), xytext=(0.1, 0.2),
                arrowprops=dict(arrowstyle="->", color="0.4", lw=1.2))
    ax.text(0.25, 2.3, "faster,\nsmaller", fontsize=11, color="0.35",
            va="center", rotation=90)
    return fig


def write_memory_hierarchy(path=None, root=None,
                           gpu: str = "A100-80GB") -> pathlib.Path:
    """Write :func:`memory_hierarchy` as deterministic SVG to ``path``
    (default ``book/_static/memory_hierarchy.svg`` of the checkout); returns
    the path. ``python -m flashlib.figures`` calls it.

    Explained in: book/gpu_memory.
    Tested in: tests/figures/test_hardware.py.
    """
    root = ROOT if root is None else pathlib.Path(root)
    path = root / MEMORY_HIERARCHY_SVG if path is None else pathlib.Path(path)
    path.write_text(to_svg(memory_hierarchy(gpu)))
    return path


# --- FlashAttention-3's schedule on Hopper ---------------------------------

def _number(name: str, value, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not low < value <= high:
        raise ValueError(f"{name} must be in ({low}, {high}], got {value!r}")
    return float(value)


def _producer(blocks: int, stages: int, load: float, k_free, v_free):
    """When K_j and V_j are in shared memory. The producer loads K_j, then
    V_j, each into slot j mod ``stages`` of its circular buffer, once that
    slot is free: K's after every consumer's GEMM0 of block j - stages
    (``k_free``), V's after every GEMM1 (``v_free``)."""
    k_ready, v_ready, t = [], [], 0.0
    for j in range(blocks):
        t = max(t, k_free[j - stages]) if j >= stages else t
        k_ready.append(t + load)
        t = max(t + load, v_free[j - stages]) if j >= stages else t + load
        v_ready.append(t + load)
        t += load
    return k_ready, v_ready


def _consumers(blocks: int, consumers: int, softmax: float, k_ready,
               v_ready):
    """The consumers' bars, the tensor cores' busy time, and when the last
    consumer finished GEMM0 and GEMM1 of each block.

    Consumer w, block j: GEMM0 (S = Q K_j^T), softmax, GEMM1 (O += P V_j).
    The tensor cores run one GEMM at a time; the consumers take turns
    (ping-pong), each turn issuing GEMM1 of block j - 1 and GEMM0 of block j
    back to back, as FA3's barriers order them."""
    bars, busy, tc = [], 0.0, 0.0
    k_done, v_done = [0.0] * blocks, [0.0] * blocks
    soft_end = [0.0] * consumers
    for j in range(blocks + 1):
        for w in range(consumers):
            gemms = ([("GEMM1", j - 1)] if j > 0 else []) + (
                [("GEMM0", j)] if j < blocks else [])
            for kind, b in gemms:
                if kind == "GEMM1":
                    start = max(tc, v_ready[b], soft_end[w])
                else:
                    start = max(tc, k_ready[b])
                tc = start + 1.0
                busy += 1.0
                label = f"PV{b}" if kind == "GEMM1" else f"QK{b}"
                bars.append((f"consumer {w + 1}", start, tc, label, kind))
                if kind == "GEMM1":
                    v_done[b] = max(v_done[b], tc)
                else:
                    k_done[b] = max(k_done[b], tc)
                    soft_end[w] = tc + softmax
                    bars.append((f"consumer {w + 1}", tc, soft_end[w],
                                 "softmax", "softmax"))
    return bars, busy, k_done, v_done


def _simulate(blocks: int, consumers: int, stages: int, softmax: float,
              load: float):
    """The bars of the schedule, ``[(row, start, end, label, kind)]``, the
    tensor cores' busy fraction and the end time (one warpgroup GEMM = 1).
    Producer and consumers wait on each other: iterate to the fixed point."""
    k_free, v_free = [0.0] * blocks, [0.0] * blocks
    for _ in range(4 * blocks + 4):
        k_ready, v_ready = _producer(blocks, stages, load, k_free, v_free)
        bars, busy, k_new, v_new = _consumers(blocks, consumers, softmax,
                                              k_ready, v_ready)
        if (k_new, v_new) == (k_free, v_free):
            break
        k_free, v_free = k_new, v_new
    for j in range(blocks):
        row = f"smem stage {j % stages}"
        for name, ready, free, half in (("K", k_ready, k_free, "top"),
                                        ("V", v_ready, v_free, "bottom")):
            bars.append(("producer (TMA)", ready[j] - load, ready[j],
                         f"{name}{j}", "load"))
            bars.append((row, ready[j] - load, free[j], f"{name}{j}",
                         "stage " + half))
    end = max(e for _, _, e, _, _ in bars)
    return bars, busy / end, end


def fa3_schedule(blocks: int = 4, *, stages: int = 2,
                 softmax_fraction: float = 0.5, load_time: float = 0.5
                 ) -> Figure:
    """FlashAttention-3's warp specialization and ping-pong schedule on one
    Hopper SM (Shah et al. 2024, Section 3.1 and Figures 1-2), as timelines.

    A producer warp issues TMA loads of K_j and V_j into a circular buffer of
    ``stages`` shared-memory slots; a slot is reused once every consumer has
    finished with it. Consumer warpgroups run GEMM0 (S = Q K_j^T) and GEMM1
    (O += P V_j) as wgmma on the tensor cores and the softmax on the other
    units. Top: one consumer warpgroup, whose softmax leaves the tensor cores
    idle. Bottom: two consumers in ping-pong, the GEMMs of one overlapping the
    softmax of the other.

    ``blocks``: key/value blocks drawn (1..8). ``softmax_fraction``: softmax
    time as a fraction of the two GEMMs' time. Default from the paper: the
    H100 SXM5 has 989 TFLOPS of fp16 matmul but 3.9 TFLOPS of exponentials;
    at head dim 128 there are 512x more matmul FLOPs than exponentials, so the
    exponentials take about 50% of the matmuls' time. ``load_time``: one TMA
    tile load, in GEMMs (an assumption of this picture: the loads are served
    mostly from L2, and are hidden either way). ``stages``: the paper's
    circular buffer, 2 slots by default. Time unit: one warpgroup GEMM.

    Explained in: notebooks/07c_hopper.
    Tested in: tests/figures/test_hardware.py.
    """
    blocks = check_int(blocks, "blocks", 1, 8)
    stages = check_int(stages, "stages", 1, 4)
    softmax = 2 * _number("softmax_fraction", softmax_fraction, 0, 4)
    load = _number("load_time", load_time, 0, 4)
    colors = {"GEMM0": COLORS[0], "GEMM1": COLORS[2], "softmax": COLORS[1],
              "load": COLORS[4], "stage": "0.85"}
    runs = [(1, "One consumer warpgroup"),
            (2, "FA3: two consumers in ping-pong")]
    fig = Figure(figsize=(10.0, 6.4), layout="constrained")
    axes = fig.subplots(2, 1, height_ratios=(2 + stages, 3 + stages))
    ends = [_simulate(blocks, c, stages, softmax, load)[2] for c, _ in runs]
    for ax, (consumers, title) in zip(axes, runs):
        bars, busy, end = _simulate(blocks, consumers, stages, softmax, load)
        rows = (["producer (TMA)"]
                + [f"smem stage {s}" for s in range(stages)]
                + [f"consumer {w + 1}" for w in range(consumers)])
        for row, start, stop, label, kind in bars:
            y, h = rows.index(row) - 0.36, 0.72
            if kind.startswith("stage"):     # K above, V below
                y, h = (y, 0.34) if kind.endswith("top") else (y + 0.38, 0.34)
            ax.add_patch(Rectangle((start, y), stop - start, h,
                                   facecolor=colors[kind.split()[0]],
                                   edgecolor="white"))
            ax.text((start + stop) / 2, y + h / 2, label, ha="center",
                    va="center", fontsize=8.5,
                    color="black" if kind.startswith("stage") else "white")
        ax.set_yticks(range(len(rows)), rows, fontsize=10)
        ax.set_ylim(len(rows) - 0.4, -0.6)
        ax.set_xlim(0, max(ends) + 0.2)
        ax.set_xlabel("time (one warpgroup GEMM = 1)")
        ax.set_ylabel("warps / buffer")
        ax.set_title(f"{title}: tensor cores busy {busy:.0%} of the time",
                     fontsize=11)
    handles = [Rectangle((0, 0), 1, 1, facecolor=colors[k])
               for k in ("load", "GEMM0", "softmax", "GEMM1")]
    fig.legend(handles, ["TMA load (producer warp)", "GEMM0: S = Q K^T (wgmma)",
                         "softmax", "GEMM1: O += P V (wgmma)"],
               loc="outside lower center", ncol=4, fontsize=9.5)
    return fig
