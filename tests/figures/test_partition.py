"""flashlib.figures.partition: FA2's warp partitioning and the backward's data flow, drawn from
flashlib's block sizes and from the ladder's own backward."""
from __future__ import annotations

import math

import pytest

from conftest import need_module

need_module("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from flashlib import IOCounter, figures  # noqa: E402
from flashlib.kernels.triton import configs, tables# noqa: E402
from flashlib.ladder import fa2  # noqa: E402
from flashlib.ladder.masks import block_hidden  # noqa: E402
from flashlib.testing import random_qkv  # noqa: E402


def _texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)


def _ticks(ax, axis: str) -> list[str]:
    return [t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")()]


# --- warp_partition ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [None, tables.CANDIDATES["fwd"][0], configs.Config(32, 16, 2, 1)])
def test_warp_partition_labels_every_warps_slice_by_index(cfg):
    fig = figures.warp_partition(cfg)
    cfg = cfg or next(c for c in tables.CANDIDATES["fwd"] if c.num_warps == 4)
    assert isinstance(fig, Figure)
    split_k, split_q = fig.axes
    assert "split-K" in split_k.get_title(loc="left") and "split-Q" in split_q.get_title(loc="left")
    assert str(cfg) in fig.get_suptitle()
    text_k, text_q = ("\n".join(t.get_text() for t in ax.texts) for ax in (split_k, split_q))
    for w in range(cfg.num_warps):
        a, b = w * cfg.block_n // cfg.num_warps, (w + 1) * cfg.block_n // cfg.num_warps
        assert f"warp {w}: cols {a}–{b - 1}" in text_k          # split-K: K's columns (keys)
        a, b = w * cfg.block_m // cfg.num_warps, (w + 1) * cfg.block_m // cfg.num_warps
        assert f"warp {w}\nrows {a}–{b - 1}" in text_q          # split-Q: query rows
    assert f"({cfg.block_m} x {cfg.block_n})" in text_q
    assert "shared memory" in text_k and "no exchange" in text_q
    # split-Q: Q, S, O split into one slice per warp (3 x num_warps), K and V shared.
    warp_patches = [p for p in split_q.patches if p.get_label().startswith("warp ")]
    assert len(warp_patches) == 3 * cfg.num_warps
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [f"warp {w}" for w in range(cfg.num_warps)] + ["read by every warp"]


def test_warp_partition_default_is_a_real_forward_config():
    fig = figures.warp_partition()
    default = next(c for c in tables.CANDIDATES["fwd"] if c.num_warps == 4)
    assert default in tables.CANDIDATES["fwd"] and str(default) in fig.get_suptitle()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"config": (64, 64)}, TypeError, "config"),
    ({"config": configs.Config(4, 64, 8, 1)}, ValueError, "config"),
    ({"d": 8}, ValueError, "d must"),
    ({"d": 64.0}, TypeError, "d must"),
])
def test_warp_partition_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        figures.warp_partition(**kwargs)


# --- backward_traffic and backward_dataflow ---------------------------------------------------------

@pytest.mark.parametrize("nq, nk, d, bq, bk, causal", [
    (256, 256, 64, 64, 64, False), (200, 300, 32, 64, 64, True), (70, 33, 16, 16, 8, True),
    (5, 9, 8, 4, 16, False)])
def test_backward_traffic_matches_the_ladders_iocounter(nq, nk, d, bq, bk, causal):
    t = figures.backward_traffic(nq, nk, d, block_q=bq, block_k=bk, causal=causal)
    assert set(t) == {"Q", "K", "V", "O", "dO", "L", "D", "dQ", "dK", "dV"}
    q, k, v = random_qkv(nq, nk, d, seed=1)
    o, lse = fa2.forward(q, k, v, causal=causal)
    io = IOCounter(bytes_per_element=2)
    fa2.backward(q, k, v, o, lse, o, causal=causal, block_q=bq, block_k=bk, io=io)
    assert sum(r for r, _ in t.values()) == io.hbm_read_bytes
    assert sum(w for _, w in t.values()) == io.hbm_write_bytes
    assert t["K"] == t["V"] == (2 * nk * d, 0) and t["dK"] == t["dV"] == (0, 2 * nk * d)
    tiles = sum(1 for j in range(0, nk, bk) for i in range(0, nq, bq)
                if not (causal and block_hidden(i, min(i + bq, nq), j, nq, nk)))
    if not causal:
        assert tiles == math.ceil(nq / bq) * math.ceil(nk / bk)
        assert t["Q"] == (2 * nq * d * math.ceil(nk / bk), 0)      # Q_i once per key block
        assert t["dQ"][1] == 2 * nq * d * (1 + math.ceil(nk / bk))  # zeroed, then once per tile


def test_backward_dataflow_draws_the_counted_bytes_and_the_tile_order():
    nq, nk, d, bq, bk = 200, 300, 32, 64, 64
    fig = figures.backward_dataflow(nq, nk, d, block_q=bq, block_k=bk, causal=True)
    flow, grid = fig.axes
    assert flow.get_title() and grid.get_title() and grid.get_xlabel() and grid.get_ylabel()
    assert f"Nq = {nq}, Nk = {nk}, d = {d}" in fig.get_suptitle()
    assert _ticks(flow, "y") == ["Q", "K", "V", "O", "dO", "L = LSE", "D", "dQ", "dK", "dV"]
    text = "\n".join(t.get_text() for t in flow.texts)
    for needle in ("D = rowsum(dO∘O)", "dQ_i += τ dS K_j", "dK_j, summed on chip", f"Q_i ({bq} x {d})",
                   f"K_j ({bk} x {d})"):
        assert needle in text
    t = figures.backward_traffic(nq, nk, d, block_q=bq, block_k=bk, causal=True)
    assert f"read {t['Q'][0] / 1024:,.0f} KiB" in text
    assert "no atomics" in flow.get_xlabel() and "separate kernel" in flow.get_xlabel()
    tiles = [(i, j) for j in range(0, nk, bk) for i in range(0, nq, bq)
             if not block_hidden(i, min(i + bq, nq), j, nq, nk)]
    numbers = sorted(int(t.get_text()) for t in grid.texts)
    assert numbers == list(range(1, len(tiles) + 1))
    assert f"[{len(tiles)} times]" in "\n".join(_ticks(flow, "x"))
    assert _ticks(grid, "x")[0] == f"0–{bk - 1}" and _ticks(grid, "y")[-1] == f"192–{nq - 1}"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"nq": 0}, ValueError, "nq"), ({"nk": 2.5}, TypeError, "nk"), ({"d": 0}, ValueError, "d must"),
    ({"block_q": 0}, ValueError, "block_q"), ({"block_k": "64"}, TypeError, "block_k"),
    ({"causal": 1}, TypeError, "causal"),
])
def test_backward_dataflow_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        figures.backward_dataflow(**kwargs)
