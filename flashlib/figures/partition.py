"""Two pictures of how FlashAttention-2 divides its work, drawn from flashlib's own data.

* :func:`warp_partition` — inside one thread block: FlashAttention-1's "split-K" (each warp holds a
  slice of K and V; the partial outputs are summed through shared memory) against FlashAttention-2's
  "split-Q" (each warp owns a slice of the query rows and sees all of K and V: no communication),
  Section 3.3 and Figure 3 of Dao (2023), at a block size and warp count of the Triton forward's
  candidates (``flashlib.kernels.triton.configs``);
* :func:`backward_dataflow` — the backward as ``flashlib.ladder.fa2.backward`` runs it (Algorithm 2):
  what each step reads from HBM and writes back, with every byte count checked against an
  :class:`~flashlib.ladder.iomodel.IOCounter` run of the ladder function, and the order of its tiles.

Explained in: notebooks/04_flashattention2 (warp_partition) and notebooks/05_backward
(backward_dataflow).
"""
from __future__ import annotations

import math

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..validation import check_flag, check_int

__all__ = ["warp_partition", "backward_dataflow", "backward_traffic"]

COLORS = matplotlib.colormaps["tab10"].colors
SHARED = "0.86"                                  # a tile every warp reads


# --- chapter 4: split-K against split-Q ------------------------------------------------------------

def _fwd_config(config):
    from ..kernels.triton import configs, tables
    if config is None:                           # the first forward candidate with 4 warps
        return next(c for c in tables.CANDIDATES["fwd"] if c.num_warps == 4)
    if not isinstance(config, configs.Config):
        raise TypeError("config must be a flashlib.kernels.triton.configs.Config, "
                        f"got {type(config).__name__}")
    return config


def _slices(n: int, parts: int) -> list[tuple[int, int]]:
    return [(w * n // parts, (w + 1) * n // parts) for w in range(parts)]


def warp_partition(config=None, *, d: int = 64) -> Figure:
    """How the warps of one thread block share a tile: split-K (FA1) against split-Q (FA2).

    One program holds a query block ``Q_i`` (``block_m x d``) and a key block ``K_j, V_j``
    (``block_n x d``) of the Triton forward's ``config`` (default: the first candidate of
    ``tables.CANDIDATES["fwd"]`` with 4 warps) and splits the work among ``config.num_warps`` warps.
    Top row, split-K: warp w takes keys (columns of ``S``) of its slice, so each warp's ``P V`` is a
    *partial* sum over its keys, for every query row: the warps must write, synchronise and add their
    partial ``O`` through shared memory. Bottom row, split-Q: warp w takes query rows of its slice and
    all keys; its rows of ``S``, ``P`` and ``O`` are its own, so no warp waits for another. Slices are
    labelled by row and column index.

    Explained in: notebooks/04_flashattention2.
    Tested in: tests/figures/test_partition.py.
    """
    cfg = _fwd_config(config)
    d = check_int(d, "d", 16, 256)
    bm, bn, warps = cfg.block_m, cfg.block_n, cfg.num_warps
    if warps > bm or warps > bn:
        raise ValueError(f"config must have at most block_m and block_n warps, got {cfg}")
    fig = Figure(figsize=(7.4, 6.4), layout="constrained")
    axes = fig.subplots(2, 1)
    scale = 1.0 / max(bm, bn, d)
    for ax, scheme in zip(axes, ("split-K", "split-Q")):
        _draw_scheme(ax, scheme, bm, bn, d, warps, scale)
    fig.suptitle(f"One Triton forward program, config {cfg}: a {bm} x {bn} tile of S, d = {d}, "
                 f"{warps} warps", fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, facecolor=COLORS[w], alpha=0.55, label=f"warp {w}")
               for w in range(warps)]
    handles.append(Rectangle((0, 0), 1, 1, facecolor=SHARED, label="read by every warp"))
    fig.legend(handles=handles, loc="outside lower center", ncol=warps + 1, frameon=False, fontsize=9)
    return fig


def _matrix(ax, x, y, w, h, title, slices=None, axis=None, shared=False, scale=1.0, hatch=None):
    """A matrix at (x, y) of w x h index units (drawn at ``scale``), split among warps along ``axis``
    ("rows" or "cols") by ``slices``; index ranges written on each slice."""
    X, Y, W, H = x, y, w * scale, h * scale
    if slices is None:
        ax.add_patch(Rectangle((X, Y), W, H, facecolor=SHARED if shared else "white",
                               edgecolor="k", lw=1.0, hatch=hatch))
    else:
        for wi, (a, b) in enumerate(slices):
            if axis == "rows":
                rect = (X, Y + H - b * scale, W, (b - a) * scale)
                label, tx, ty = f"rows {a}–{b - 1}", X + W / 2, Y + H - (a + b) / 2 * scale
            else:
                rect = (X + a * scale, Y, (b - a) * scale, H)
                label, tx, ty = f"cols {a}–{b - 1}", X + (a + b) / 2 * scale, Y + H / 2
            ax.add_patch(Rectangle(rect[:2], *rect[2:], facecolor=COLORS[wi], alpha=0.55,
                                   edgecolor="k", lw=0.8, hatch=hatch, label=f"warp {wi}"))
            ax.text(tx, ty, f"warp {wi}: {label}" if axis == "cols" else f"warp {wi}\n{label}",
                    ha="center", va="center", fontsize=6.5, rotation=90 if axis == "cols" else 0)
    ax.text(X + W / 2, Y + H + 0.04, title, ha="center", va="bottom", fontsize=8)
    return X + W


def _draw_scheme(ax, scheme, bm, bn, d, warps, scale):
    rows_q, cols_k = _slices(bm, warps), _slices(bn, warps)
    gap, x, y = 0.3, 0.0, 0.0
    if scheme == "split-K":
        x = _matrix(ax, x, y, d, bm, f"$Q_i$ ({bm} x {d})\nshared", shared=True, scale=scale)
        x = _matrix(ax, x + gap, y, bn, d, f"$K_j^T$ ({d} x {bn})\ncolumns split", cols_k, "cols",
                    scale=scale)
        x = _matrix(ax, x + gap, y, bn, bm, f"$S_{{ij}}$, $P_{{ij}}$ ({bm} x {bn})\ncolumns split",
                    cols_k, "cols", scale=scale)
        _split_v_rows(ax, x + gap, y, d, bn, cols_k, scale)
        ax.text(x + gap + d * scale / 2, y + bn * scale + 0.04,
                f"$V_j$ ({bn} x {d})\nrows split like $K_j^T$", ha="center", va="bottom",
                fontsize=8)
        x = x + gap + d * scale
        x0 = x + gap
        for wi in reversed(range(warps)):            # one partial O_i per warp, stacked like cards
            off = 0.035 * wi
            light = tuple(0.55 * c + 0.45 for c in COLORS[wi])      # opaque: the cards overlap
            ax.add_patch(Rectangle((x0 + off, y - off), d * scale, bm * scale, facecolor=light,
                                   edgecolor="k", lw=0.8, label=f"warp {wi}"))
        ax.text(x0 + d * scale / 2, y + bm * scale / 2, f"{warps} partial\n$O_i$, all\nrows 0–{bm - 1}",
                ha="center", va="center", fontsize=7)
        ax.text(x0 + d * scale / 2, y + bm * scale + 0.04,
                f"$O_i$ ({bm} x {d}): a partial\nsum per warp", ha="center", va="bottom",
                fontsize=8)
        x = x0 + d * scale + 0.035 * warps
        note = (f"Each of the {warps} warps holds a partial $O_i$ (and a partial row max and sum) for "
                f"all {bm} rows:\nthey are written to shared memory, the warps synchronise, and "
                "the partial results are added:\nshared-memory traffic and a barrier at every key block.")
        title = "FlashAttention-1: split-K — each warp takes a slice of the keys"
    else:
        x = _matrix(ax, x, y, d, bm, f"$Q_i$ ({bm} x {d})\nrows split", rows_q, "rows", scale=scale)
        x = _matrix(ax, x + gap, y, bn, d, f"$K_j^T$ ({d} x {bn})\nshared", shared=True, scale=scale)
        x = _matrix(ax, x + gap, y, bn, bm, f"$S_{{ij}}$, $P_{{ij}}$ ({bm} x {bn})\nrows split",
                    rows_q, "rows", scale=scale)
        x = _matrix(ax, x + gap, y, d, bn, f"$V_j$ ({bn} x {d})\nshared", shared=True, scale=scale)
        x = _matrix(ax, x + gap, y, d, bm, f"$O_i$ ({bm} x {d})\nrows split", rows_q, "rows",
                    scale=scale)
        note = ("Warp w owns its rows of $Q_i$, $S$, $P$ and $O_i$ and reads all of $K_j$ and $V_j$:\n"
                "its softmax statistics and output rows need no other warp, so there is no exchange\n"
                "through shared memory and no barrier for the output.")
        title = "FlashAttention-2: split-Q — each warp takes a slice of the query rows"
    ax.text(0.0, y - 0.22, note, ha="left", va="top", fontsize=8)
    ax.set_xlim(-0.05, max(x, 5.6) + 0.05)
    ax.set_ylim(y - 0.78, y + max(bm, d) * scale + 0.4)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(title, fontsize=10, loc="left")


def _split_v_rows(ax, x, y, d, bn, cols_k, scale):
    """V_j's rows split like K_j^T's columns (warp w multiplies its P columns by its V rows)."""
    H = bn * scale
    for wi, (a, b) in enumerate(cols_k):
        ax.add_patch(Rectangle((x, y + H - b * scale), d * scale, (b - a) * scale,
                               facecolor=COLORS[wi], alpha=0.55, edgecolor="k", lw=0.8,
                               label=f"warp {wi}"))
        ax.text(x + d * scale / 2, y + H - (a + b) / 2 * scale, f"warp {wi}\nrows {a}–{b - 1}",
                ha="center", va="center", fontsize=6.5)


# --- chapter 5: the backward's data flow ------------------------------------------------------------

def _tiles(nq, nk, br, bc, causal):
    """The (i, j) tiles ``fa2.backward`` visits, in its order: key blocks outside, query blocks inside."""
    from ..ladder.masks import block_hidden
    return [(i, j) for j in range(0, nk, bc) for i in range(0, nq, br)
            if not (causal and block_hidden(i, min(i + br, nq), j, nq, nk))]


def backward_traffic(nq: int, nk: int, d: int, *, block_q: int, block_k: int, causal: bool = False,
                     bytes_per_element: int = 2) -> dict[str, tuple[int, int]]:
    """HBM bytes ``{tensor: (read, written)}`` of ``flashlib.ladder.fa2.backward`` for one head
    (``Nq x d`` queries, ``Nk x d`` keys and values), counted tensor by tensor from the structure of
    Algorithm 2 as the ladder runs it; their sums are what an
    :class:`~flashlib.ladder.iomodel.IOCounter` counts while the ladder function runs (the test
    checks it on adversarial shapes). Tensors: Q, K, V, O, dO, L (the saved log-sum-exp), D = rowsum(dO * O), dQ, dK, dV.

    Explained in: notebooks/05_backward.
    Tested in: tests/figures/test_partition.py.
    """
    nq, nk = check_int(nq, "nq", 1, 4096), check_int(nk, "nk", 1, 4096)
    d = check_int(d, "d", 1, 256)
    br, bc = check_int(block_q, "block_q", 1), check_int(block_k, "block_k", 1)
    causal = check_flag(causal, "causal")
    b = check_int(bytes_per_element, "bytes_per_element", 1, 8)
    tiles = _tiles(nq, nk, br, bc, causal)
    rows = sum(min(i + br, nq) - i for i, _ in tiles)        # query rows loaded, over all tiles
    t = {"Q": (rows * d, 0), "dO": (nq * d + rows * d, 0), "O": (nq * d, 0), "L": (rows, 0),
         "D": (rows, nq), "K": (nk * d, 0), "V": (nk * d, 0), "dQ": (rows * d, nq * d + rows * d),
         "dK": (0, nk * d), "dV": (0, nk * d)}
    t = {name: (r * b, w * b) for name, (r, w) in t.items()}
    return t


def backward_dataflow(nq: int = 256, nk: int = 256, d: int = 64, *, block_q: int = 64,
                      block_k: int = 64, causal: bool = False) -> Figure:
    """The backward as ``flashlib.ladder.fa2.backward`` runs it (Algorithm 2 of Dao 2023).

    Left: the tensors in HBM and the chip of one key-block program, with arrows for what is read and
    written, when (once, per key block, per tile), and the bytes each tensor moves in total for this
    problem (fp16, from :func:`backward_traffic`, whose test checks it against an IOCounter run). ``D =
    rowsum(dO * O)`` is computed once before the loops; ``dK_j``, ``dV_j`` accumulate on chip over the
    query blocks and are written once; ``dQ_i`` is read, added to and written back at every tile (the
    ladder runs its tiles one after another, so no atomics; on a GPU the key-block programs run at the
    same time, and flashlib's Triton backward computes dQ in a separate kernel instead). Right: the
    tiles in the order the ladder visits them, key blocks outside.

    Explained in: notebooks/05_backward.
    Tested in: tests/figures/test_partition.py.
    """
    traffic = backward_traffic(nq, nk, d, block_q=block_q, block_k=block_k, causal=causal)
    tiles = _tiles(nq, nk, block_q, block_k, causal)
    tr, tc = math.ceil(nq / block_q), math.ceil(nk / block_k)
    fig = Figure(figsize=(7.6, 8.4), layout="constrained")
    flow, grid = fig.subplots(2, 1, height_ratios=(1.75, 1))
    _draw_flow(flow, traffic, tr, tc, len(tiles), block_q, block_k, nq, d)
    _draw_tiles(grid, tiles, nq, nk, block_q, block_k, tr, tc)
    fig.suptitle(f"fa2.backward, one head: Nq = {nq}, Nk = {nk}, d = {d}, blocks {block_q} x "
                 f"{block_k}, {'causal' if causal else 'not causal'}", fontsize=10)
    return fig


def _kb(x: int) -> str:
    return f"{x / 1024:,.0f} KiB" if x >= 10 * 1024 else f"{x:,} B"


# Algorithm 2 as fa2.backward runs it: (stage, tensor) -> what happens, tile shapes filled in later.
STAGES = ("before the loops\n(lines 3-4)", "per key block j,\nbefore (lines 6-7)",
          "per tile (i, j)\n(lines 9-16)", "per key block j,\nafter (line 18)")
TENSORS = ("Q", "K", "V", "O", "dO", "L", "D", "dQ", "dK", "dV")
READ, WRITE, BOTH = "read", "write", "read + write"
_FLOW = {
    ("O", 0): (READ, "O (N_q x d)"), ("dO", 0): (READ, "dO (N_q x d)"),
    ("D", 0): (WRITE, "D = rowsum(dO∘O)"), ("dQ", 0): (WRITE, "dQ = 0"),
    ("K", 1): (READ, "K_j (B_c x d)"), ("V", 1): (READ, "V_j (B_c x d)"),
    ("Q", 2): (READ, "Q_i (B_r x d)"), ("dO", 2): (READ, "dO_i (B_r x d)"),
    ("L", 2): (READ, "L_i (B_r)"), ("D", 2): (READ, "D_i (B_r)"),
    ("dQ", 2): (BOTH, "dQ_i += τ dS K_j"),
    ("dK", 3): (WRITE, "dK_j, summed on chip"), ("dV", 3): (WRITE, "dV_j, summed on chip"),
}
_FACE = {READ: "#cfe2f3", WRITE: "#f4cccc", BOTH: "#e1d5e7"}


def _draw_flow(ax, t, tr, tc, n_tiles, br, bc, nq, d):
    for r, name in enumerate(TENSORS):
        for c in range(len(STAGES)):
            kind, text = _FLOW.get((name, c), (None, ""))
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor=_FACE.get(kind, "white"), edgecolor="0.6",
                                   lw=0.8))
            if kind:
                text = (text.replace("B_r", str(br)).replace("B_c", str(bc))
                        .replace("N_q", str(nq)).replace("x d", f"x {d}"))
                ax.text(c + 0.5, r + 0.5, f"{kind}\n{text}", ha="center", va="center", fontsize=8)
        read, written = t[name]
        total = " + ".join(x for x in (f"read {_kb(read)}" if read else "",
                                       f"written {_kb(written)}" if written else "") if x)
        ax.add_patch(Rectangle((len(STAGES), r), 1.4, 1, facecolor="white", edgecolor="0.6", lw=0.8))
        ax.text(len(STAGES) + 0.7, r + 0.5, total.replace(" + ", "\n"), ha="center", va="center",
                fontsize=8)
    ax.set_xlim(0, len(STAGES) + 1.4), ax.set_ylim(len(TENSORS), 0)
    counts = ("once", f"{tc} times", f"{n_tiles} times", f"{tc} times")
    ax.set_xticks([c + 0.5 for c in range(len(STAGES))] + [len(STAGES) + 0.7],
                  [f"{s}\n[{n}]" for s, n in zip(STAGES, counts)] + ["HBM bytes,\nall steps (fp16)"],
                  fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([r + 0.5 for r in range(len(TENSORS))],
                  ["Q", "K", "V", "O", "dO", "L = LSE", "D", "dQ", "dK", "dV"], fontsize=8.5)
    ax.tick_params(length=0)
    ax.set_ylabel("tensor in HBM")
    ax.set_xlabel("On chip only, never in HBM: S, P, dP, dS (one tile) and the dK_j, dV_j sums.\n"
                  "dQ_i is read, added to and written back at every tile: the ladder runs the\n"
                  "tiles one after another, so no atomics; flashlib's Triton backward runs dQ\n"
                  "as a separate kernel.", fontsize=8)
    ax.set_title("What each step reads from HBM and writes back (Algorithm 2)", fontsize=10)


def _draw_tiles(ax, tiles, nq, nk, br, bc, tr, tc):
    order = {tile: n + 1 for n, tile in enumerate(tiles)}
    for i in range(0, nq, br):
        for j in range(0, nk, bc):
            w, h = min(bc, nk - j), min(br, nq - i)
            if (i, j) in order:
                ax.add_patch(Rectangle((j, i), w, h, facecolor=COLORS[(j // bc) % 10], alpha=0.35,
                                       edgecolor="k", lw=0.8))
                ax.text(j + w / 2, i + h / 2, str(order[i, j]), ha="center", va="center", fontsize=8)
            else:
                ax.add_patch(Rectangle((j, i), w, h, facecolor="white", edgecolor="0.5", hatch="///",
                                       lw=0.8))
    ax.set_xlim(0, nk), ax.set_ylim(nq, 0)
    ax.set_aspect("equal")
    ax.set_xticks([j + min(bc, nk - j) / 2 for j in range(0, nk, bc)],
                  [f"{j}–{min(j + bc, nk) - 1}" for j in range(0, nk, bc)],
                  fontsize=8, rotation=30 if tc > 5 else 0)
    ax.set_yticks([i + min(br, nq - i) / 2 for i in range(0, nq, br)],
                  [f"{i}–{min(i + br, nq) - 1}" for i in range(0, nq, br)], fontsize=8)
    ax.set_xlabel("key block j, by key index (one colour: one program; its $dK_j$, $dV_j$ "
                  "stay on chip)",
                  fontsize=8.5)
    ax.set_ylabel("query block i, by query index\n($dQ_i$: read and written\nat every tile)",
                  fontsize=8.5)
    ax.set_title("The tiles in the order fa2.backward visits them (hatched: skipped, causal)",
                 fontsize=10)
