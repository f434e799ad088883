"""Serving in pictures: what padding wastes, where a paged cache puts a
token, and the one merge of attention states behind four algorithms.

* :func:`padding_cost` - a ragged batch as padded score matrices (``B``
  squares of ``max_len``) beside the packed one that ``cu_seqlens``
  describes (only the ``len_i x len_i`` blocks on its diagonal);
* :func:`page_owners` - which sequences' logical pages each physical
  page holds (what :func:`paged_cache` draws);
* :func:`paged_cache` - a paged KV cache drawn from its data: each
  sequence's logical pages, the physical pool, and the block table's
  arrows between them (shared pages, free pages, unwritten rows);
* :func:`merge_uses` - the merge ``(o, lse) = (o_a, lse_a) + (o_b, lse_b)``
  as a tree over the keys, for the online softmax, Flash-Decoding's
  combine, a ring step and cascade decoding (the splits and the ring's
  order come from ``flashlib.ladder.decoding.split_bounds`` and
  ``flashlib.parallel.ring.chunk_ids``).

Explained in: notebooks/10_serving.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..validation import check_int
from ._base import COLORS

__all__ = ["padding_cost", "paged_cache", "page_owners", "merge_uses",
           "MERGE_USES"]

MAX_LEN = 512            # the longest sequence padding_cost draws
MAX_SEQS = 12            # sequences a picture can still label
MAX_PAGES = 64           # physical pages paged_cache can still draw
MAX_PAGE_SIZE = 32       # rows per page it can still draw


def _lengths(lengths, name: str = "lengths", low: int = 0) -> list[int]:
    """A 1-D list of ints >= low (Python, NumPy or torch)."""
    if type(lengths).__module__.startswith("torch"):
        lengths = lengths.detach().cpu().tolist()
    if isinstance(lengths, np.ndarray):
        if lengths.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {lengths.shape}")
        lengths = lengths.tolist()
    if not isinstance(lengths, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got "
                        f"{type(lengths).__name__}")
    if not 1 <= len(lengths) <= MAX_SEQS:
        raise ValueError(f"{name} must hold 1 to {MAX_SEQS} sequences, got "
                         f"{len(lengths)}")
    return [check_int(n, f"{name}[{i}]", low, MAX_LEN)
            for i, n in enumerate(lengths)]


# ---- ragged batches ----------------------------------------------------

def _light(color, alpha=0.6):
    """``color`` blended with white: opaque, so no hatch shows through."""
    return tuple(alpha * c + (1 - alpha) for c in color[:3])


def padding_cost(lengths) -> Figure:
    """A ragged batch of sequence ``lengths``, two ways, each as the
    (query, key) pairs a kernel computes. Left: padded to the longest,
    ``B`` problems of ``max_len x max_len`` (drawn on a diagonal), of which
    only ``len_i x len_i`` are real pairs; the rest (hatched) is computed
    and thrown away. Right: packed end to end, as ``cu_seqlens``
    describes it (the ticks); a varlen kernel computes only the blocks on
    the diagonal, ``sum len_i^2`` pairs, and never visits the rest of the
    packed matrix. Titles give both counts and their ratio.

    Explained in: notebooks/10_serving.
    Tested in: tests/figures/test_serving.py.
    """
    lens = _lengths(lengths)
    b, top, total = len(lens), max(lens), sum(lens)
    if top == 0:
        raise ValueError("lengths must hold at least one token, got all 0")
    padded, packed = b * top * top, sum(n * n for n in lens)
    fig = Figure(figsize=(8.6, 4.8))
    ax_pad, ax_pack = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.82, bottom=0.2,
                        wspace=0.3)
    for ax, size, width in ((ax_pad, [top] * b, b * top),
                            (ax_pack, lens, total)):
        ax.add_patch(Rectangle((0, 0), width, width, facecolor="white",
                               edgecolor="0.4", lw=0.8))
        edges = np.cumsum([0] + size)
        for i, (start, n) in enumerate(zip(edges[:-1], lens)):
            if ax is ax_pad:
                ax.add_patch(Rectangle((start, start), top, top,
                                       facecolor="white", edgecolor="0.4",
                                       hatch="///", lw=0.8))
            if n:
                ax.add_patch(Rectangle((start, start), n, n,
                                       facecolor=_light(COLORS[i % 10]),
                                       edgecolor="0.2", lw=0.6))
        ax.set_xticks(edges, [str(e) for e in edges], fontsize=7)
        ax.set_yticks(edges, [str(e) for e in edges], fontsize=7)
        ax.set_xlim(0, width), ax.set_ylim(width, 0)
        ax.set_aspect("equal")
    ax_pad.set_title(f"padded: B x max_len^2 = {b} x {top}^2\n"
                     f"= {padded:,} pairs", fontsize=10)
    ax_pad.set_xlabel(f"key row, padded (B x max_len = {b} x {top})")
    ax_pad.set_ylabel("query row, padded")
    ax_pack.set_title(f"packed: sum len_i^2 = {packed:,} pairs\n"
                      f"({padded / packed:.1f}x fewer)", fontsize=10)
    ax_pack.set_xlabel("key row of the packed k (ticks: cu_seqlens)")
    ax_pack.set_ylabel("query row of the packed q")
    fig.suptitle(f"{b} sequences of lengths {lens}", fontsize=11, y=0.98)
    fig.legend(handles=[Patch(facecolor=COLORS[0], alpha=0.6,
                              label="a real (query, key) pair"),
                        Patch(facecolor="white", edgecolor="0.4", hatch="///",
                              label="padding: computed, then discarded"),
                        Patch(facecolor="white", edgecolor="0.4",
                              label="never visited")],
               loc="lower center", ncol=3, frameon=False, fontsize=8.5)
    return fig


# ---- paged caches ------------------------------------------------------

def _table(block_table) -> np.ndarray:
    if type(block_table).__module__.startswith("torch"):
        block_table = block_table.detach().cpu().numpy()
    if not isinstance(block_table, np.ndarray):
        raise TypeError("block_table must be an integer array (B, max_pages), "
                        f"got {type(block_table).__name__}")
    if block_table.dtype.kind not in "iu":
        raise TypeError(f"block_table must hold integers, got dtype "
                        f"{block_table.dtype}")
    if block_table.ndim != 2 or 0 in block_table.shape:
        raise ValueError("block_table must be 2-D (B, max_pages) and not "
                         f"empty, got shape {block_table.shape}")
    return block_table.astype(np.int64)


def page_owners(block_table, seqlens, page_size: int,
                num_pages: int) -> dict[int, list[tuple[int, int]]]:
    """``{page: [(b, logical page), ...]}`` for every physical page some
    sequence uses (its first ``ceil(seqlens[b] / page_size)`` entries of
    ``block_table``); pages not listed are free. Checks what
    :func:`paged_cache` draws: lengths within the capacity, entries in
    ``[0, num_pages)``.

    Explained in: notebooks/10_serving.
    Tested in: tests/figures/test_serving.py.
    """
    table = _table(block_table)
    lens = _lengths(seqlens, "seqlens")
    size = check_int(page_size, "page_size", 1)
    pages = check_int(num_pages, "num_pages", 1)
    if len(lens) != table.shape[0]:
        raise ValueError(f"seqlens must give one length per row of "
                         f"block_table ({table.shape[0]}), got {len(lens)}")
    owners: dict[int, list[tuple[int, int]]] = {}
    for b, n in enumerate(lens):
        used = math.ceil(n / size)
        if used > table.shape[1]:
            raise ValueError(f"seqlens[{b}] = {n} needs {used} pages of "
                             f"{size}, block_table has {table.shape[1]}")
        for p in range(used):
            page = int(table[b, p])
            if not 0 <= page < pages:
                raise ValueError(f"block_table[{b}, {p}] = {page} is not a "
                                 f"page: num_pages is {pages}")
            owners.setdefault(page, []).append((b, p))
    return owners


def paged_cache(block_table, seqlens, page_size: int, *,
                num_pages: int | None = None) -> Figure:
    """A paged KV cache from its data. Left: each sequence ``b``'s tokens
    ``0 .. seqlens[b] - 1`` in logical pages of ``page_size``; right: the
    physical pool of ``num_pages`` pages (default: one past the largest
    page used), each row coloured by the sequence whose token lives there
    and labelled with the token's position; an arrow per used entry of
    ``block_table (B, max_pages)``. Token ``t`` of sequence ``b`` is row
    ``t % page_size`` of page ``block_table[b, t // page_size]``. Free
    pages are hatched; a page used by two sequences (a shared prefix) is
    labelled so; rows of a used page past the length are white (not yet
    written). Only the used entries are read: the rest may be garbage.

    Explained in: notebooks/10_serving.
    Tested in: tests/figures/test_serving.py.
    """
    table = _table(block_table)
    lens = _lengths(seqlens, "seqlens")
    size = check_int(page_size, "page_size", 1, MAX_PAGE_SIZE)
    if len(lens) != table.shape[0]:
        raise ValueError(f"seqlens must give one length per row of "
                         f"block_table ({table.shape[0]}), got {len(lens)}")
    used = [int(table[b, p]) for b, n in enumerate(lens)
            for p in range(min(math.ceil(n / size), table.shape[1]))]
    if num_pages is None:
        num_pages = max(used, default=0) + 1
    pages = check_int(num_pages, "num_pages", 1, MAX_PAGES)
    owners = page_owners(table, lens, size, pages)
    cols = max(math.ceil(n / size) for n in lens) or 1
    fig = Figure(figsize=(8.6, max(3.6, 0.34 * pages + 1.6)))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.02, right=0.98, top=0.88, bottom=0.13)
    # logical side: pages of a sequence side by side, sequences stacked
    cell, pgap = 1.0, 0.5
    page_w = size * cell
    left_w = cols * (page_w + pgap)
    row_h = pages / max(len(lens), 1)
    x_pool = left_w + max(6.0, 0.45 * left_w)
    for b, n in enumerate(lens):
        color = COLORS[b % 10]
        y = (b + 0.5) * row_h
        ax.text(-0.3, y, f"seq {b}\nlen {n}", ha="right", va="center",
                fontsize=8.5)
        for p in range(math.ceil(n / size)):
            x = p * (page_w + pgap)
            for r in range(size):
                t = p * size + r
                ax.add_patch(Rectangle((x + r * cell, y - 0.4), cell, 0.8,
                                       facecolor=_light(color) if t < n
                                       else "white", edgecolor="0.3",
                                       lw=0.5, zorder=2))
                if t < n and size * cols <= 48:
                    ax.text(x + (r + 0.5) * cell, y, str(t), ha="center",
                            va="center", fontsize=6.5, zorder=4)
            ax.add_patch(Rectangle((x, y - 0.4), page_w, 0.8, fill=False,
                                   edgecolor="black", lw=1.2, zorder=3))
            page = int(table[b, p])
            ax.annotate("", xy=(x_pool - 0.2, page + 0.5),
                        xytext=(x + page_w, y),
                        arrowprops=dict(arrowstyle="->", color=color,
                                        lw=1.0, alpha=0.8,
                                        shrinkA=1, shrinkB=1), zorder=1)
            ax.text(x + page_w / 2, y - 0.5, f"[{b}, {p}] -> {page}",
                    ha="center", va="bottom", fontsize=6.5)
    # physical side: the pool, one page per row
    for page in range(pages):
        who = owners.get(page, [])
        for r in range(size):
            facecolor, label = "white", ""
            for b, p in who:
                t = p * size + r
                if t < lens[b]:
                    facecolor, label = COLORS[b % 10], str(t)
                    break
            ax.add_patch(Rectangle((x_pool + r * cell, page + 0.1), cell,
                                   0.8, facecolor=_light(facecolor) if label
                                   else "white",
                                   hatch=None if who else "///",
                                   edgecolor="0.3", lw=0.5, zorder=2))
            if label and size <= 16:
                ax.text(x_pool + (r + 0.5) * cell, page + 0.5, label,
                        ha="center", va="center", fontsize=6.5, zorder=4)
        ax.add_patch(Rectangle((x_pool, page + 0.1), page_w, 0.8, fill=False,
                               edgecolor="black", lw=1.2, zorder=3))
        note = ("free" if not who else
                "shared by seqs " + ", ".join(str(b) for b, _ in who)
                if len(who) > 1 else "")
        ax.text(x_pool + page_w + 0.3, page + 0.5,
                f"page {page}" + (f": {note}" if note else ""), ha="left",
                va="center", fontsize=7.5)
    ax.text(left_w / 2, -0.3, "logical pages (block_table[b, p])",
            ha="center", va="bottom", fontsize=9.5)
    ax.text(x_pool + page_w / 2, -0.3, "physical pages (k_cache rows)",
            ha="center", va="bottom", fontsize=9.5)
    ax.set_xlim(-3.2, x_pool + page_w + 9.0)
    ax.set_ylim(pages + 0.2, -1.4)
    ax.set_axis_off()
    free = pages - len(owners)
    ax.set_title(f"page_size {size}: {len(lens)} sequences, {sum(lens)} "
                 f"tokens in {len(owners)} of {pages} pages ({free} free); "
                 f"token t of seq b: page block_table[b, t // {size}], "
                 f"row t % {size}", fontsize=9)
    fig.legend(handles=[Patch(facecolor=_light(COLORS[0]),
                              edgecolor="0.3", label="a written token (its "
                              "position t)"),
                        Patch(facecolor="white", edgecolor="0.3",
                              label="allocated, not yet written"),
                        Patch(facecolor="white", edgecolor="0.3",
                              hatch="///", label="free page")],
               loc="lower center", ncol=3, frameon=False, fontsize=8.5)
    return fig


# ---- the one merge -----------------------------------------------------

# The four uses drawn by merge_uses: (title, where the book explains it)
MERGE_USES = (
    ("online softmax: a fold over key blocks, in order", "chapters 2, 4"),
    ("Flash-Decoding: splits in parallel, one combine", "chapter 6"),
    ("ring attention: one merge per step, chunks in the ring's order",
     "chapter 12"),
    ("cascade decoding: the shared prefix read once, then a merge per "
     "sequence", "chapter 10"),
)


def _segments(ax, bounds, labels, colors, y=0.0):
    for (a, b), text, color in zip(bounds, labels, colors):
        ax.add_patch(Rectangle((a, y), b - a, 0.6, facecolor=color,
                               alpha=0.5, edgecolor="0.2", lw=0.8))
        ax.text((a + b) / 2, y + 0.3, text, ha="center", va="center",
                fontsize=8)


def _node(ax, x, y, text=r"$\oplus$", color="white"):
    ax.text(x, y, text, ha="center", va="center", fontsize=9,
            bbox=dict(boxstyle="circle,pad=0.15" if "oplus" in text else
                      "round,pad=0.25", facecolor=color, edgecolor="0.2"))


def _edge(ax, a, b):
    ax.plot([a[0], b[0]], [a[1], b[1]], color="0.35", lw=0.9, zorder=0)


def merge_uses(nk: int = 16, *, block_k: int = 4, num_splits: int = 4,
               world: int = 4, rank: int = 1, prefix: int = 8,
               suffixes=(4, 5)) -> Figure:
    """One merge, four algorithms, drawn over the keys each one splits:
    the online softmax folds the states of blocks of ``block_k`` keys in
    order; Flash-Decoding attends to ``num_splits`` splits
    (``ladder.decoding.split_bounds``) in parallel and combines them once;
    ring attention's ``rank`` of ``world`` merges one chunk per step, in
    the ring's order (``parallel.ring.chunk_ids`` of the rank it came
    from); cascade decoding attends to a shared ``prefix`` once for every
    sequence and merges each sequence's state over its own ``suffixes``.
    A leaf is a state ``(o, lse)`` over its keys; a circle is
    ``merge_states``. The merge is associative and commutative, so every
    tree gives the same ``(o, lse)``.

    Explained in: notebooks/10_serving.
    Tested in: tests/figures/test_serving.py.
    """
    from ..ladder.decoding import split_bounds
    nk = check_int(nk, "nk", 2, 64)
    bk = check_int(block_k, "block_k", 1, nk)
    splits = check_int(num_splits, "num_splits", 1, nk)
    world = check_int(world, "world", 2, 8, " (and at most nk)")
    if world > nk:
        raise ValueError(f"world must be at most nk = {nk}, got {world}")
    rank = check_int(rank, "rank", 0, world - 1)
    prefix = check_int(prefix, "prefix", 1, 64)
    if not (isinstance(suffixes, (tuple, list)) and 1 <= len(suffixes) <= 4):
        raise TypeError(f"suffixes must be a tuple of 1 to 4 lengths, got "
                        f"{suffixes!r}")
    suffixes = [check_int(s, f"suffixes[{i}]", 1, 64)
                for i, s in enumerate(suffixes)]
    fig = Figure(figsize=(8.6, 8.2))
    axes = fig.subplots(4, 1)
    fig.subplots_adjust(left=0.03, right=0.97, top=0.92, bottom=0.04,
                        hspace=0.45)
    grey = "0.85"
    # (a) online softmax: a left fold
    ax = axes[0]
    blocks = [(j, min(j + bk, nk)) for j in range(0, nk, bk)]
    _segments(ax, blocks, [f"keys {a}..{b - 1}" if b - a > 2 else f"{a}.."
                           for a, b in blocks], [COLORS[0]] * len(blocks))
    leaves = [((a + b) / 2, 1.4) for a, b in blocks]
    for j, leaf in enumerate(leaves):
        _node(ax, *leaf, f"$s_{{{j}}}$", grey)
        _edge(ax, leaf, ((blocks[j][0] + blocks[j][1]) / 2, 0.6))
    acc = leaves[0]
    for j in range(1, len(leaves)):
        node = ((blocks[j][0] + blocks[j][1]) / 2 - bk / 4, 1.4 + 0.9 * j)
        _edge(ax, acc, node), _edge(ax, leaves[j], node)
        _node(ax, *node)
        acc = node
    # (b) Flash-Decoding: all splits, one combine
    ax = axes[1]
    parts = split_bounds(nk, splits)
    _segments(ax, parts, [f"split {s}" if b - a > 2 else str(s)
                          for s, (a, b) in enumerate(parts)],
              [COLORS[1 + s % 9] for s in range(len(parts))])
    top = (nk / 2, 3.2)
    for s, (a, b) in enumerate(parts):
        leaf = ((a + b) / 2, 1.6)
        _edge(ax, leaf, ((a + b) / 2, 0.6)), _edge(ax, leaf, top)
        _node(ax, *leaf, f"$s_{{{s}}}$", grey)
    _node(ax, *top, "combine: merge_states_many", "white")
    # (c) ring: rank's step t merges the chunk of rank (rank - t) % world
    ax = axes[2]
    _ring_panel(ax, nk, world, rank, grey)
    # (d) cascade: a shared prefix, one suffix per sequence
    ax = axes[3]
    _cascade_panel(ax, prefix, suffixes, grey)
    for ax, (title, where) in zip(axes, MERGE_USES):
        ax.set_title(f"{title} ({where})", fontsize=9.5, loc="left")
        ax.set_ylim(-0.4, 5.2)
        ax.set_axis_off()
    for ax in axes[:3]:
        ax.set_xlim(-0.5, nk + 0.5)
    fig.suptitle(r"$(o, L) = (o_a, L_a) \oplus (o_b, L_b)$:  "
                 r"$L = \log(e^{L_a} + e^{L_b})$,  "
                 r"$o = e^{L_a - L} o_a + e^{L_b - L} o_b$",
                 fontsize=10.5, y=0.995)
    return fig


def _ring_panel(ax, nk, world, rank, grey):
    from ..parallel.ring import chunk_ids
    edges = [(c * nk) // world for c in range(world + 1)]
    chunks = list(zip(edges[:-1], edges[1:]))
    _segments(ax, chunks, [f"rank {c}'s keys" if b - a > 3 else f"r{c}"
                           for c, (a, b) in enumerate(chunks)],
              [COLORS[2 + c % 8] for c in range(world)])
    order = [chunk_ids((rank - t) % world, world)[0] for t in range(world)]
    leaves = {}
    for t, c in enumerate(order):
        a, b = chunks[c]
        leaves[c] = ((a + b) / 2, 1.4)
        _edge(ax, leaves[c], ((a + b) / 2, 0.6))
        _node(ax, *leaves[c], f"step {t}", grey)
    acc = leaves[order[0]]
    for t in range(1, world):
        node = (nk * (t + 0.5) / world, 1.4 + 0.95 * t)
        _edge(ax, acc, node), _edge(ax, leaves[order[t]], node)
        _node(ax, *node)
        acc = node
    ax.text(nk + 0.4, 4.6, f"on rank {rank} of {world}", ha="right",
            fontsize=8.5)


def _cascade_panel(ax, prefix, suffixes, grey):
    x, bounds = prefix, [(0, prefix)]
    for s in suffixes:
        bounds.append((x + 1, x + 1 + s))       # a gap: another sequence
        x += 1 + s
    labels = ["shared prefix (read once)"] + [
        f"seq {i}'s own" if b - a >= 4 else f"seq {i}"
        for i, (a, b) in enumerate(bounds[1:])]
    _segments(ax, bounds, labels, ["0.55"] + [COLORS[4 + i % 6]
                                              for i in range(len(suffixes))])
    n = len(suffixes)
    for i, (a, b) in enumerate(bounds[1:]):
        px = prefix * (i + 0.5) / n
        shared = (px, 1.6)
        own = ((a + b) / 2, 1.6)
        _edge(ax, shared, (px, 0.6)), _edge(ax, own, ((a + b) / 2, 0.6))
        _node(ax, *shared, f"$p_{{{i}}}$", grey)
        _node(ax, *own, f"$s_{{{i}}}$", grey)
        node = ((px + own[0]) / 2, 3.3)
        _edge(ax, shared, node), _edge(ax, own, node)
        _node(ax, *node)
        ax.text(node[0], node[1] + 0.75, f"seq {i}", ha="center",
                fontsize=8)
    ax.set_xlim(-0.5, x + 0.5)
