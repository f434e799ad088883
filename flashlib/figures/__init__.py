"""Pictures of the book's ideas, each drawn from flashlib's own data, never from typed-in numbers.

* :func:`roadmap` — the ladder of chapters and the flashlib module behind each (the landing page's
  ``book/_static/roadmap.svg``, rewritten by :func:`write_roadmap` or ``python -m flashlib.figures``);
* :func:`hbm_traffic` — HBM <-> SRAM bytes of standard attention and FlashAttention-1, counted by
  :class:`~flashlib.ladder.iomodel.IOCounter` while they run;
* :func:`program_grid` — the programs the Triton forward kernel launches and the key blocks each loads;
* :func:`split_kv` — Flash-Decoding's splits, their partial log-sum-exps and the combine's weights;
* :func:`online_softmax_animation` and :func:`ring_animation` — playable HTML/JS (matplotlib's
  ``to_jshtml``) of the online softmax's running state and of ring attention's schedule.

Static pictures are matplotlib Figures (made without pyplot, so nothing is shown twice); a chapter
shows them as vector graphics with :func:`svg`. Animations are HTML strings, shown with
``IPython.display.HTML``; their frames are PNGs at a modest resolution, at most :data:`MAX_FRAMES`.

Explained in: notebooks/03_flashattention1 (and every chapter with one of these pictures).
"""
from __future__ import annotations

import math
import numbers
import pathlib
import re

import matplotlib
import numpy as np
from matplotlib.animation import FuncAnimation
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrow, FancyArrowPatch, FancyBboxPatch, Polygon, Rectangle
from matplotlib.ticker import FuncFormatter
from ..validation import check_int
from ._base import COLORS, ROOT, to_svg

__all__ = ["MAX_FRAMES", "CHAPTER_MODULES", "svg", "to_svg", "roadmap", "write_roadmap", "hbm_traffic",
           "program_grid", "split_kv", "online_softmax_animation", "ring_animation"]

MAX_FRAMES = 16                       # an animation's frames: enough to follow, small enough for a page
ANIMATION_DPI = 80                    # its PNG frames: sharp enough, a few tens of KB each
ROADMAP_SVG = pathlib.Path("book") / "_static" / "roadmap.svg"

# The flashlib modules behind each chapter (tests/test_figures.py checks that each module's docstring
# says it is explained in that chapter).
CHAPTER_MODULES: dict[int, tuple[str, ...]] = {
    1: ("ladder.naive", "ladder.iomodel"),
    2: ("ladder.softmax", "ladder.memeff"),
    3: ("ladder.fa1",),
    4: ("ladder.fa2",),
    5: ("ladder.fa2",),
    6: ("ladder.decoding",),
    7: ("kernels.triton",),
    8: ("kernels.cuda",),
    9: ("ladder.masks", "ladder.dropout", "hf"),
    10: ("ladder.serving", "serving"),
    11: ("models", "auto"),
    12: ("parallel.ring",),
}


# --- checks ---------------------------------------------------------------------------------------

def _choice(name: str, value, options) -> str:
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _float_array(name: str, x, ndim: int) -> np.ndarray:
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.ndim != ndim or 0 in x.shape:
        raise ValueError(f"{name} must be a non-empty {ndim}-D array, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must hold finite numbers only")
    return x


# --- output: crisp SVG for pictures, HTML/JS for animations --------------------------------------

def svg(fig: Figure):
    """Show ``fig`` in a notebook as vector graphics (an ``IPython.display.SVG``; the text elsewhere).

    Explained in: notebooks/03_flashattention1.
    Tested in: tests/test_figures.py.
    """
    text = to_svg(fig)
    try:
        from IPython.display import SVG
    except ImportError:  # pragma: no cover - IPython ships with every notebook environment
        return text
    return SVG(data=text)


def _animate(fig: Figure, update, n_frames: int, fps: float) -> str:
    """``update(i)`` drawn for i = 0 .. n_frames - 1, as matplotlib's HTML/JS player (frames embedded)."""
    anim = FuncAnimation(fig, update, frames=n_frames, interval=1000 / fps, repeat=False)
    with matplotlib.rc_context({"animation.frame_format": "png", "savefig.dpi": ANIMATION_DPI}):
        html = anim.to_jshtml(fps=fps, default_mode="once")
    # The player's buttons use Font Awesome from a CDN; the book needs no network: Unicode symbols instead.
    html = re.sub(r'<link rel="stylesheet"\s+href="https?://[^"]*font-awesome[^"]*">\s*', "", html)
    return re.sub(r'<i class="fa ([^"]+)"></i>', lambda m: _BUTTONS.get(m.group(1), "?"), html)


_BUTTONS = {"fa-minus": "\u2212", "fa-plus": "+", "fa-fast-backward": "\u21e4", "fa-step-backward": "\u25c1",
            "fa-play fa-flip-horizontal": "\u25c0", "fa-pause": "\u2016", "fa-play": "\u25b6",
            "fa-step-forward": "\u25b7", "fa-fast-forward": "\u21e5"}   # symbols every common font has


def _fps(fps) -> float:
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not 0 < fps <= 30:
        raise ValueError(f"fps must be a number in (0, 30], got {fps!r}")
    return float(fps)


def _mb(ax, axis: str = "y") -> None:
    """Tick labels of a byte axis in MB (10^6 bytes); the plotted numbers stay bytes."""
    fmt = FuncFormatter(lambda b, _: f"{b / 1e6:g}")
    (ax.yaxis if axis == "y" else ax.xaxis).set_major_formatter(fmt)


# --- the roadmap of the landing page --------------------------------------------------------------

def _chapters(root: pathlib.Path) -> list[tuple[str, str, int, str]]:
    """``(part caption, notebook, number, title)`` of every chapter in ``_toc.yml``, in order.

    The number and title come from the notebook's first heading (``# 3. FlashAttention-1``); the
    appendices (``notebooks/appendix_*``) are not rungs of the ladder."""
    import json
    toc = root / "_toc.yml"
    if not toc.is_file():
        raise FileNotFoundError(f"roadmap needs a flashbook checkout: no _toc.yml in {root}")
    chapters, caption = [], ""
    for line in toc.read_text().splitlines():
        if m := re.match(r"\s*-\s*caption:\s*(.+?)\s*$", line):
            caption = m.group(1)
        elif m := re.match(r"\s*-\s*file:\s*(notebooks/\d\d_\S+?)\s*$", line):   # not appendices
            nb = json.loads((root / (m.group(1) + ".ipynb")).read_text())
            text = "".join(next(c["source"] for c in nb["cells"] if c["cell_type"] == "markdown"))
            head = re.search(r"^#\s+(\d+)\.\s+(.+?)\s*$", text, re.M)
            if head is None:
                raise ValueError(f"{m.group(1)}: its first cell has no heading like '# 3. Title'")
            chapters.append((caption, m.group(1), int(head.group(1)), head.group(2)))
    return chapters


# The one idea each chapter adds to the one before, in a few words (the roadmap's second line).
CHAPTER_IDEAS: dict[int, str] = {
    1: "the N × N scores go to HBM",
    2: "softmax in one pass",
    3: "tiles in SRAM: less HBM traffic",
    4: "queries outside, rescale once",
    5: "recompute P from the LSE",
    6: "split the keys, merge by LSE",
    7: "the tiles as a GPU kernel",
    8: "threads, warps, tensor cores",
    9: "windows, softcaps, sinks, dropout",
    10: "ragged batches, paged caches, one merge",
    11: "train and generate a small GPT",
    12: "one sequence over many GPUs",
}


def _short_title(title: str) -> str:
    """A chapter's heading up to its colon: "Triton kernels: FlashAttention-2 ..." -> "Triton kernels"."""
    return title.split(":", 1)[0].strip()


def roadmap(root=None) -> Figure:
    """The book as a ladder a reader can read at the page's width: every chapter of ``_toc.yml`` (its
    number and its heading up to a colon) with the one idea it adds (:data:`CHAPTER_IDEAS`), grouped by
    part, arrows from rung to rung. Only chapters (``notebooks/NN_*``) are rungs: sub-pages
    (``notebooks/07b_*``) and appendices are not.

    ``root``: the checkout (default: the one this flashlib lives in).
    Explained in: book/intro.
    Tested in: tests/test_figures.py.
    """
    root = ROOT if root is None else pathlib.Path(root)
    chapters = _chapters(root)
    parts = list(dict.fromkeys(c[0] for c in chapters))
    # two columns: the algorithm ladder on the left, everything after it on the right
    left = [c for c in chapters if c[0] == parts[0]]
    right = [c for c in chapters if c[0] != parts[0]]
    rows = max(len(left), len(right) + 0.4 * (len(parts) - 2) / 1.12)
    box_w, box_h, step, gap = 3.75, 0.82, 1.12, 0.7
    width = 2 * box_w + gap + 0.2
    height = rows * step + 0.55
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width), ax.set_ylim(height, 0), ax.axis("off")
    centres = {}
    for col, column in enumerate((left, right)):
        x, y = 0.1 + col * (box_w + gap), 0.55 - step
        for row, (part, _, number, title) in enumerate(column):
            y += step + (0.4 if row and column[row - 1][0] != part else 0)   # room for a part's caption
            color = COLORS[parts.index(part)]
            if row == 0 or column[row - 1][0] != part:       # the part's caption above its first box
                ax.text(x, y - 0.12, part, fontsize=12, color=color, fontweight="bold", va="bottom")
            ax.add_patch(FancyBboxPatch((x, y), box_w, box_h, boxstyle="round,pad=0,rounding_size=0.1",
                                        facecolor=color, alpha=0.15, edgecolor=color, lw=1.5))
            ax.text(x + 0.15, y + 0.3, f"{number}", fontsize=16, fontweight="bold", color=color,
                    va="center")
            ax.text(x + 0.62, y + 0.27, _short_title(title), fontsize=13.5, fontweight="bold", va="center")
            ax.text(x + 0.62, y + 0.6, CHAPTER_IDEAS.get(number, ""), fontsize=12, va="center",
                    color="0.2")
            centres[number] = (x, y)
    numbers = [c[2] for c in chapters]
    for a, b in zip(numbers, numbers[1:]):                   # the ladder: each rung to the next
        (xa, ya), (xb, yb) = centres[a], centres[b]
        if xa == xb:                                         # down the column
            ax.add_patch(FancyArrowPatch((xa + box_w / 2, ya + box_h), (xb + box_w / 2, yb),
                                         arrowstyle="-|>", mutation_scale=14, color="0.45", lw=1.4))
        else:                                # across the gap: from the left column's last rung, up
            mid = xa + box_w + gap / 2
            ax.plot([xa + box_w, mid, mid], [ya + box_h / 2, ya + box_h / 2, yb + box_h / 2],
                    color="0.45", lw=1.4)
            ax.add_patch(FancyArrowPatch((mid, yb + box_h / 2), (xb, yb + box_h / 2),
                                         arrowstyle="-|>", mutation_scale=14, color="0.45", lw=1.4))
    return fig


def write_roadmap(path=None, root=None) -> pathlib.Path:
    """Write :func:`roadmap` as deterministic SVG (:func:`to_svg`) to ``path``
    (default ``book/_static/roadmap.svg`` of the checkout); returns the path.

    Run ``python -m flashlib.figures`` after changing a chapter's heading or ``_toc.yml``.
    Explained in: book/intro.
    Tested in: tests/test_figures.py.
    """
    root = ROOT if root is None else pathlib.Path(root)
    path = root / ROADMAP_SVG if path is None else pathlib.Path(path)
    path.write_text(to_svg(roadmap(root)))
    return path


# --- chapter 3: HBM <-> SRAM traffic ---------------------------------------------------------------

def _traffic(n: int, d: int, sram_bytes: int, bytes_per_element: int, causal: bool):
    """IOCounters of standard attention and FlashAttention-1 (paper block sizes for ``sram_bytes``)."""
    from ..ladder import fa1, naive
    from ..ladder.iomodel import IOCounter
    from ..testing import random_qkv
    q, k, v = random_qkv(n, n, d, dtype=np.float32)
    io_std = IOCounter(bytes_per_element)
    naive.attention(q, k, v, causal=causal, io=io_std)
    io_fa1 = IOCounter(bytes_per_element, sram_bytes=sram_bytes)
    fa1.forward(q, k, v, causal=causal, sram_bytes=sram_bytes, io=io_fa1)
    return {"standard attention": io_std, "FlashAttention-1": io_fa1}


def hbm_traffic(n: int = 1024, d: int = 64, *, sram_bytes: int = 100 * 1024, bytes_per_element: int = 2,
                causal: bool = False) -> Figure:
    """Standard attention vs FlashAttention-1 on one head of ``n`` queries and keys, head dim ``d``:
    the bytes each reads from and writes to HBM, counted by an IOCounter while it runs, drawn as
    arrows between HBM and an SRAM of ``sram_bytes`` (left) and as bars (right).

    FlashAttention-1 uses the paper's block sizes for ``sram_bytes`` (``fa1.paper_block_sizes``).
    Explained in: notebooks/03_flashattention1.
    Tested in: tests/test_figures.py.
    """
    n, d = check_int(n, "n", 1, 8192), check_int(d, "d", 1, 512)
    sram_bytes = check_int(sram_bytes, "sram_bytes", 1)
    bytes_per_element = check_int(bytes_per_element, "bytes_per_element", 1, 8)
    causal = _flag("causal", causal)
    from ..ladder import fa1
    br, bc = fa1.paper_block_sizes(sram_bytes, d, bytes_per_element)     # ValueError if M < 4d
    counters = _traffic(n, d, sram_bytes, bytes_per_element, causal)
    colors = (COLORS[3], COLORS[0])

    fig = Figure(figsize=(11, 4.4), layout="constrained")
    ax_h, ax_b = fig.subplots(1, 2, width_ratios=(1.1, 1))
    ax_h.set_xlim(0, 10), ax_h.set_ylim(0, 10), ax_h.axis("off")
    ax_h.set_title("Bytes crossing between the memories (arrow width ∝ bytes)", fontsize=10)
    fa1_io = counters["FlashAttention-1"]
    ax_h.add_patch(Rectangle((2.5, 7.4), 5, 2.0, facecolor="#e8f1fa", edgecolor="0.3"))
    ax_h.text(5, 8.9, f"on-chip SRAM of one SM: M = {sram_bytes / 1024:g} KB", ha="center", fontsize=9)
    ax_h.text(5, 8.0, f"FlashAttention-1's tiles $K_j, V_j, Q_i, O_i$ ($B_r$={br}, $B_c$={bc}):\n"
              f"peak {fa1_io.peak_sram_bytes / 1024:.1f} KB of {sram_bytes / 1024:g} KB",
              ha="center", va="center", fontsize=8.5)
    ax_h.add_patch(Rectangle((0.5, 0.4), 9, 2.2, facecolor="#f4efe6", edgecolor="0.3"))
    ax_h.text(5, 1.9, "HBM (off-chip, large, slow)", ha="center", fontsize=9)
    ax_h.text(5, 1.0, f"Q, K, V, O: {n}×{d} each   |   standard attention also: S, P ({n}×{n})",
              ha="center", fontsize=8)
    largest = max(max(io.hbm_read_bytes, io.hbm_write_bytes) for io in counters.values())
    for i, ((name, io), color) in enumerate(zip(counters.items(), colors)):
        x = 3.0 + 4.0 * i
        for dx, (label, nbytes, y0, y1) in zip((-0.55, 0.55), (("read", io.hbm_read_bytes, 2.75, 6.5),
                                                                ("write", io.hbm_write_bytes, 6.5, 2.75))):
            width = 0.08 + 0.6 * nbytes / largest                 # arrow width ∝ bytes
            ax_h.add_patch(FancyArrow(x + dx, y0, 0, y1 - y0, width=width, head_width=width + 0.35,
                                      head_length=0.45, length_includes_head=True, color=color, alpha=0.8))
            ax_h.text(x + dx + (0.5 if dx > 0 else -0.5), 4.6, f"{label}\n{nbytes / 1e6:.2f} MB",
                      ha="left" if dx > 0 else "right", va="center", fontsize=8, color=color)
        ax_h.text(x, 6.95, name, ha="center", fontsize=8.5, color=color, fontweight="bold")

    names = list(counters)
    reads = [counters[k].hbm_read_bytes for k in names]
    writes = [counters[k].hbm_write_bytes for k in names]
    x = np.arange(len(names))
    ax_b.bar(x, reads, 0.5, color=colors, alpha=0.9, label="read from HBM")
    ax_b.bar(x, writes, 0.5, bottom=reads, color=colors, alpha=0.45, hatch="//", label="written to HBM")
    for xi, r, w in zip(x, reads, writes):
        ax_b.text(xi, r + w, f"{(r + w) / 1e6:.2f} MB", ha="center", va="bottom", fontsize=9)
    floor = 4 * n * d * bytes_per_element                       # Q, K, V read once, O written once
    ax_b.axhline(floor, color="0.3", ls="--", lw=1)
    ax_b.text(0.5, floor, "floor: read Q, K, V\nand write O once", ha="center", va="bottom", fontsize=8)
    ax_b.set_xticks(x, names)
    ax_b.set_xlabel("algorithm (one forward pass)")
    ax_b.set_ylabel("HBM traffic (MB = 10⁶ bytes)")
    _mb(ax_b)
    ax_b.set_ylim(0, 1.15 * max(r + w for r, w in zip(reads, writes)))
    ax_b.legend(loc="upper right", fontsize=8)
    ax_b.set_title(f"Counted by IOCounter: one head, N = {n}, d = {d}, "
                   f"{bytes_per_element} B/element{', causal' if causal else ''}", fontsize=10)
    return fig


# --- chapter 7: the Triton forward's program grid --------------------------------------------------

def _key_blocks(q0: int, q1: int, nq: int, nk: int, block_n: int, causal: bool) -> tuple[int, int]:
    """(full, masked): key blocks a query block [q0, q1) loads whole, and those it loads with a mask
    (diagonal or ragged end); hidden blocks are never loaded. From the ladder's own mask rules."""
    from ..ladder.masks import block_hidden, causal_mask
    full = masked = 0
    for k0 in range(0, nk, block_n):
        k1 = min(k0 + block_n, nk)
        if causal and block_hidden(q0, q1, k0, nq, nk):
            continue
        whole = k1 - k0 == block_n and (not causal or causal_mask(q0, q1, k0, k1, nq, nk).all())
        full, masked = full + whole, masked + (not whole)
    return full, masked


def program_grid(B: int = 2, H: int = 2, nq: int = 1024, nk: int | None = None, *, config=None,
                 causal: bool = True) -> Figure:
    """The programs of the Triton forward kernel (``fa2_fwd_v1.grid``): one per (batch·head, query block)
    on a flat axis, query block fastest, each cell labelled with its program id and coloured by the key
    blocks it loads (whole + masked; hidden causal blocks are skipped).

    ``config``: a ``configs.Config`` (default: the first forward candidate, ``tables.CANDIDATES["fwd"][0]``).
    Explained in: notebooks/07_triton.
    Tested in: tests/test_figures.py.
    """
    from ..kernels.triton import configs, fa2_fwd_v1, tables
    B, H, nq = check_int(B, "B", 1, 8), check_int(H, "H", 1, 8), check_int(nq, "nq", 1)
    nk = nq if nk is None else check_int(nk, "nk", 1)
    causal = _flag("causal", causal)
    config = tables.CANDIDATES["fwd"][0] if config is None else config
    if not isinstance(config, configs.Config):
        raise TypeError(f"config must be a flashlib.kernels.triton.configs.Config, got {type(config).__name__}")
    bm, bn = config.block_m, config.block_n
    n_blocks = math.ceil(nq / bm)
    if n_blocks > 32:
        raise ValueError(f"nq / block_m must give at most 32 query blocks to draw, got {n_blocks} "
                         f"(nq={nq}, block_m={bm})")
    programs = fa2_fwd_v1.grid(B, H, nq, bm)[0]
    per_block = [_key_blocks(i * bm, min((i + 1) * bm, nq), nq, nk, bn, causal) for i in range(n_blocks)]
    loads = np.tile([full + masked for full, masked in per_block], (B * H, 1))   # (B·H, query blocks)
    fig = Figure(figsize=(max(6.0, 0.75 * n_blocks + 2.5), 0.6 * B * H + 1.9), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(loads, cmap="Blues", vmin=0, vmax=max(1, loads.max()), aspect="auto")
    for pid in range(programs):                               # pid = bh * n_blocks + i  (kit.unflatten)
        bh, i = divmod(pid, n_blocks)
        full, masked = per_block[i]                           # every head's query block i: the same work
        dark = loads[bh, i] > 0.6 * loads.max()
        ax.text(i, bh, f"{pid}\n{full}+{masked}", ha="center", va="center", fontsize=7.5,
                color="white" if dark else "black")
    ax.set_xticks(range(n_blocks), [f"{i * bm}–{min((i + 1) * bm, nq) - 1}" for i in range(n_blocks)],
                  rotation=45 if n_blocks > 6 else 0, fontsize=8)
    ax.set_yticks(range(B * H), [f"b={bh // H}, h={bh % H}" for bh in range(B * H)], fontsize=8)
    ax.set_xlabel(f"query block (rows; BLOCK_M = {bm})")
    ax.set_ylabel("batch · head")
    fig.colorbar(image, ax=ax, label=f"key blocks loaded (BLOCK_N = {bn})")
    ax.set_title(f"fa2_fwd_v1.grid({B}, {H}, {nq}, {bm}) = {programs} programs; cell: program id, "
                 f"whole + masked key blocks\n(Nq = {nq}, Nk = {nk}, {'causal' if causal else 'not causal'})",
                 fontsize=10)
    return fig


# --- chapter 6: split-KV and the combine ------------------------------------------------------------

def split_kv(q, k, v, num_splits: int = 4) -> Figure:
    """Flash-Decoding on one query ``q (1, d)`` against ``k (Nk, d)``, ``v (Nk, dv)``: the cache cut by
    ``decoding.split_bounds``, each split's ``LSE_s`` from ``decoding.forward`` on its chunk, and the
    weights ``exp(LSE_s - LSE)`` with which ``decoding.combine`` adds the partial outputs.

    Explained in: notebooks/06_flash_decoding.
    Tested in: tests/test_figures.py.
    """
    from ..ladder import decoding
    q, k, v = _float_array("q", q, 2), _float_array("k", k, 2), _float_array("v", v, 2)
    if q.shape[0] != 1 or k.shape[1] != q.shape[1] or v.shape[0] != k.shape[0]:
        raise ValueError(f"q must be (1, d), k (Nk, d) and v (Nk, dv), got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    nk = k.shape[0]
    num_splits = check_int(num_splits, "num_splits", 1, min(12, nk))
    bounds = decoding.split_bounds(nk, num_splits)
    parts = [decoding.forward(q, k[a:b], v[a:b], num_splits=1) for a, b in bounds]   # kernel 1
    o_parts, lse_parts = np.stack([o for o, _ in parts]), np.stack([lse for _, lse in parts])
    _, lse = decoding.combine(o_parts, lse_parts)                                    # kernel 2
    lse_s, total = lse_parts[:, 0], float(lse[0])
    weights = np.exp(lse_s - total)
    colors = [COLORS[s % 10] for s in range(num_splits)]

    fig = Figure(figsize=(10, 5.2), layout="constrained")
    axes = fig.subplot_mosaic([["cache", "cache"], ["lse", "weight"]], height_ratios=(0.3, 1))
    ax_c, ax_l, ax_w = axes["cache"], axes["lse"], axes["weight"]
    for s, (a, b) in enumerate(bounds):
        ax_c.add_patch(Rectangle((a, 0), b - a, 1, facecolor=colors[s], alpha=0.6, edgecolor="white"))
        ax_c.text((a + b) / 2, 0.5, f"split {s}\n{b - a} keys", ha="center", va="center", fontsize=8)
    ax_c.set_xlim(0, nk), ax_c.set_ylim(0, 1), ax_c.set_yticks([])
    ax_c.set_xlabel("key position in the cache")
    ax_c.set_title(f"1. the cache of one query, cut by split_bounds({nk}, {num_splits}): one program "
                   f"per split", fontsize=10)
    x = np.arange(num_splits)
    ax_l.bar(x, lse_s, color=colors, alpha=0.8)
    ax_l.axhline(total, color="0.2", ls="--", lw=1, label=f"combined LSE = {total:.2f}")
    ax_l.set_ylim(min(0.0, lse_s.min()) - 0.5, max(lse_s.max(), total) + 1.0)
    ax_l.set_xticks(x, [f"split {s}" for s in x], fontsize=8)
    ax_l.set_ylabel("log-sum-exp of the split's scores")
    ax_l.legend(fontsize=8, loc="upper left")
    ax_l.set_title("2. each split writes (O_s, LSE_s)", fontsize=10)
    ax_w.bar(x, weights, color=colors, alpha=0.8)
    ax_w.set_xticks(x, [f"split {s}" for s in x], fontsize=8)
    ax_w.set_ylabel("weight w_s = exp(LSE_s − LSE)")
    ax_w.set_ylim(0, 1.05)
    ax_w.set_title(f"3. combine: O = Σ w_s O_s  (Σ w_s = {weights.sum():.3f})", fontsize=10)
    return fig


# --- chapter 2: the online softmax, step by step -----------------------------------------------------

def _online_softmax_movie(x):
    """(figure, update, n_frames) of the online softmax of ``x``: one frame per element, then pass 2."""
    from ..ladder import softmax
    x = _float_array("x", x, 1)
    n = check_int(x.shape[0], "len(x)", 2, MAX_FRAMES - 1)
    states = [softmax.online_state(x[:j + 1]) for j in range(n)]          # (m_j, l_j) after element j
    y = softmax.online_softmax(x)
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax_x, ax_e = fig.subplots(1, 2)
    pos = np.arange(n)
    bars_x = ax_x.bar(pos, x, color="0.85")
    m_line = ax_x.axhline(states[0][0], color=COLORS[3], lw=1.5, label="running max m")
    ax_x.set_xlabel("position j"), ax_x.set_ylabel("score x_j")
    lo = min(0.0, x.min())
    ax_x.set_ylim(lo - 0.5, x.max() + 0.6 * (x.max() - lo) + 1.0)      # room for the legend
    ax_x.legend(handles=[m_line, *(Rectangle((0, 0), 1, 1, color=c) for c in (COLORS[0], COLORS[1], "0.85"))],
                labels=["running max m", "read", "read now: x_j", "not read yet"], loc="upper left", fontsize=8)
    bars_e = ax_e.bar(pos, np.zeros(n), color=COLORS[0])
    ax_e.set_xlabel("position i"), ax_e.set_ylim(0, 1.15)
    note = ax_e.text(0.98, 0.97, "", transform=ax_e.transAxes, ha="right", va="top", fontsize=9,
                     bbox=dict(facecolor="white", edgecolor="0.7"))
    for ax in (ax_x, ax_e):
        ax.set_xticks(pos)

    def update(j):
        done = min(j, n - 1)
        m, l = states[done]
        for i, bar in enumerate(bars_x):
            bar.set_color(COLORS[1] if i == j else COLORS[0] if i <= done else "0.85")
        m_line.set_ydata([m, m])
        if j < n:                                                    # pass 1: element j arrives
            m_prev = states[j - 1][0] if j else -np.inf
            shown = np.where(pos <= j, np.exp(x - m), 0.0)
            rescale = math.exp(m_prev - m) if j else 0.0
            ax_x.set_title(f"pass 1, element j = {j}: m = {m:.2f}", fontsize=10)
            ax_e.set_ylabel("exp(x_i − m): terms of the running sum l")
            ax_e.set_title("first element: m = x_0, l = 1" if j == 0
                           else "the max grew: old terms × exp(m_old − m)" if rescale < 1
                           else "the max did not grow: l += exp(x_j − m)", fontsize=10)
            note.set_text(f"l = Σ = {l:.3f}" + (f"\nrescaled by {rescale:.3f}" if j and rescale < 1 else ""))
        else:                                                        # pass 2: normalize
            shown = y
            ax_x.set_title(f"pass 2: every x_j against the final m = {m:.2f}", fontsize=10)
            ax_e.set_ylabel("softmax y_i = exp(x_i − m) / l")
            ax_e.set_title("pass 2: y = exp(x − m) / l", fontsize=10)
            note.set_text(f"l = {l:.3f}, Σ y = {y.sum():.3f}")
        for bar, h in zip(bars_e, shown):
            bar.set_height(h)
        return [*bars_x, *bars_e, m_line, note]

    update(0)
    return fig, update, n + 1


def online_softmax_animation(x, *, fps: float = 1.5) -> str:
    """The online softmax (``softmax.online_state``) playing over the row ``x`` (2 to 15 finite
    scores): one frame per element — the running max ``m`` and the terms of the running sum ``l``,
    rescaled when ``m`` grows — then one frame of pass 2. Returns matplotlib's HTML/JS player.

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/test_figures.py.
    """
    fps = _fps(fps)
    fig, update, frames = _online_softmax_movie(x)
    return _animate(fig, update, frames, fps)


# --- chapter 12: ring attention's schedule ------------------------------------------------------------

def _ring_plan(world: int, layout: str, causal: bool):
    """(rank, step, query chunk a, key chunk b, mode) in the order ``_RingAttention.forward`` meets them."""
    from ..parallel import ring
    return [(r, s, a, b, ring._mode(a, b, causal))
            for r in range(world) for s in range(world)
            for b in ring.chunk_ids((r - s) % world, world, layout)
            for a in ring.chunk_ids(r, world, layout)]


def _ring_movie(world: int, layout: str, causal: bool):
    """(figure, update, n_frames): one frame per ring step."""
    from ..parallel import ring
    world = check_int(world, "world", 2, 8)
    layout = _choice("layout", layout, ring.LAYOUTS)
    causal = _flag("causal", causal)
    plan = _ring_plan(world, layout, causal)
    n_chunks = world * len(ring.chunk_ids(0, world, layout))
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax_r, ax_m = fig.subplots(1, 2)
    angle = [math.pi / 2 - 2 * math.pi * r / world for r in range(world)]
    xy = [(math.cos(t), math.sin(t)) for t in angle]
    for r in range(world):                                   # the ring: rank r sends to rank r + 1
        a, b = np.array(xy[r]), np.array(xy[(r + 1) % world])
        ax_r.add_patch(FancyArrowPatch(a, b, connectionstyle="arc3,rad=-0.25", arrowstyle="-|>",
                                       mutation_scale=12, color="0.5", shrinkA=24, shrinkB=24))
        ax_r.add_patch(Circle(xy[r], 0.3, facecolor=COLORS[r], alpha=0.35, edgecolor=COLORS[r]))
        ax_r.text(*xy[r], f"rank {r}", ha="center", va="center", fontsize=8, fontweight="bold")
    held_text = [ax_r.text(1.38 * x, 1.38 * y, "", va="center", fontsize=9,
                           ha="left" if x > 0.3 else "right" if x < -0.3 else "center") for x, y in xy]
    ax_r.set_title("the ring: each rank sends the K/V it holds to rank r + 1", fontsize=10)
    ax_r.set_xlim(-1.8, 1.8), ax_r.set_ylim(-1.8, 1.8), ax_r.set_aspect("equal"), ax_r.axis("off")
    size = 1.0 / n_chunks
    ax_m.set_xlim(0, 1), ax_m.set_ylim(1, 0), ax_m.set_aspect("equal")
    ticks = [(c + 0.5) * size for c in range(n_chunks)]
    ax_m.set_xticks(ticks, [f"K{c}" for c in range(n_chunks)], fontsize=8)
    ax_m.set_yticks(ticks, [f"Q{c}" for c in range(n_chunks)], fontsize=8)
    ax_m.set_xlabel("key chunk (position in the sequence →)"), ax_m.set_ylabel("query chunk")
    ax_m.set_title(f"score blocks computed so far, in the colour of their rank\n({layout} layout, "
                   f"{'causal' if causal else 'not causal'}; bright: this step; number: the step)", fontsize=10)
    shapes, labels = {}, {}                                   # (a, b) -> the patch, the step number
    for r, s, a, b, mode in plan:
        x0, y0 = b * size, a * size
        ax_m.add_patch(Rectangle((x0, y0), size, size, facecolor="0.93", edgecolor="white"))
        if mode == "full":
            shapes[a, b] = Rectangle((x0, y0), size, size, facecolor=COLORS[r], edgecolor="white")
        elif mode == "causal":                               # the diagonal block: its lower triangle
            shapes[a, b] = Polygon([(x0, y0), (x0, y0 + size), (x0 + size, y0 + size)],
                                   facecolor=COLORS[r], edgecolor="white")
        if (a, b) in shapes:
            ax_m.add_patch(shapes[a, b])
            labels[a, b] = ax_m.text(x0 + (0.5 if mode == "full" else 0.3) * size,
                                     y0 + (0.5 if mode == "full" else 0.72) * size, str(s),
                                     ha="center", va="center", fontsize=8)

    def update(step):
        for r in range(world):
            held = ring.chunk_ids((r - step) % world, world, layout)
            held_text[r].set_text("holds " + ",".join(f"K{c}" for c in held))
        for r, s, a, b, mode in plan:
            if (a, b) in shapes:
                shapes[a, b].set_alpha(0.0 if s > step else 0.95 if s == step else 0.35)
                labels[a, b].set_visible(s <= step)
        fig.suptitle(f"ring attention, W = {world}, step {step} (of 0–{world - 1}): rank r attends its queries to the "
                     f"K/V of rank (r − {step}) mod {world}" + ("" if step == world - 1 else ", then passes it on"),
                     fontsize=10.5)
        return [*held_text, *shapes.values(), *labels.values()]

    update(0)
    return fig, update, world


def ring_animation(world: int = 4, layout: str = "zigzag", *, causal: bool = True, fps: float = 1.0) -> str:
    """Ring attention's schedule (``ring.chunk_ids``, ``ring._mode``, iterated as the forward pass
    does), one frame per step: which K/V chunks each rank holds, and which blocks of the score matrix
    it computes (rank's colour; bright: this step, faded: earlier; grey: skipped or not yet).
    ``world`` 2..8 ranks. Returns matplotlib's HTML/JS player.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/test_figures.py.
    """
    fps = _fps(fps)
    fig, update, frames = _ring_movie(world, layout, causal)
    return _animate(fig, update, frames, fps)


from .hardware import fa3_schedule, memory_hierarchy, write_memory_hierarchy  # noqa: E402,F401
from .partition import warp_partition, backward_dataflow, backward_traffic  # noqa: E402,F401
from .masks import mask_tiles, tile_counts  # noqa: E402,F401
from .serving import padding_cost, paged_cache, page_owners, merge_uses  # noqa: E402,F401
