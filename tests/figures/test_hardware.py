"""flashlib.figures.hardware: the memory hierarchy and FA3's schedule, drawn from flashlib's numbers."""
from __future__ import annotations

import pytest

from conftest import ROOT, need_module

need_module("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from flashlib import figures, hardware  # noqa: E402
from flashlib.figures.hardware import MEMORY_FACTS, _simulate  # noqa: E402


def _texts(fig: Figure) -> str:
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)


# --- the memory hierarchy ---------------------------------------------------------------------------

def test_every_gpu_of_the_table_has_its_memory_facts():
    assert set(MEMORY_FACTS) == set(hardware.GPUS)


@pytest.mark.parametrize("name", sorted(hardware.GPUS))
def test_memory_hierarchy_shows_the_tables_numbers(name):
    gpu = hardware.get(name)
    fig = figures.memory_hierarchy(name)
    text = _texts(fig)
    assert isinstance(fig, Figure) and name in text
    for level in ("registers", "shared memory (SRAM)", "L2 cache"):
        assert level in text
    assert f"{gpu.smem_per_block_kb} KB per SM x {gpu.sms} SMs" in text
    assert f"{gpu.bandwidth_gbs / 1000:.1f} TB/s" in text
    assert f"{MEMORY_FACTS[name][0]} GB" in text and f"{MEMORY_FACTS[name][2]} MB" in text


def test_a100_shared_memory_bandwidth_is_the_papers_19_tb_s():
    assert "~19 TB/s" in _texts(figures.memory_hierarchy("A100-40GB"))


@pytest.mark.parametrize("bad,error", [("B200", ValueError), (3, TypeError)])
def test_memory_hierarchy_refuses_an_unknown_gpu(bad, error):
    with pytest.raises(error, match="name"):
        figures.memory_hierarchy(bad)


def test_the_committed_memory_hierarchy_is_what_the_function_draws_now():
    committed = (ROOT / "book" / "_static" / "memory_hierarchy.svg").read_text()
    assert committed == figures.to_svg(figures.memory_hierarchy()), (
        "book/_static/memory_hierarchy.svg is stale: regenerate it with `python -m flashlib.figures`")


def test_write_memory_hierarchy_writes_the_deterministic_svg(tmp_path):
    path = figures.write_memory_hierarchy(tmp_path / "m.svg")
    assert path.read_text() == figures.to_svg(figures.memory_hierarchy())


# --- FA3's schedule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("blocks,stages", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("consumers", [1, 2])
def test_schedule_respects_every_dependency(blocks, stages, consumers):
    bars, busy, end = _simulate(blocks, consumers, stages, 1.0, 0.5)
    gemms = sorted((s, e) for row, s, e, _, kind in bars if kind.startswith("GEMM"))
    assert len(gemms) == 2 * blocks * consumers
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(gemms, gemms[1:])), "one GEMM at a time"
    assert busy == pytest.approx(len(gemms) / end)
    loads = {label: e for row, s, e, label, kind in bars if kind == "load"}
    for row, s, e, label, kind in bars:
        if kind == "GEMM0":
            assert s >= loads["K" + label[2:]] - 1e-9, "QK_j waits for K_j"
        if kind == "GEMM1":
            assert s >= loads["V" + label[2:]] - 1e-9, "PV_j waits for V_j"
    for s in range(stages):                            # a slot holds one K (and one V) at a time
        for half in ("stage top", "stage bottom"):
            held = sorted((b0, b1) for row, b0, b1, _, kind in bars
                          if row == f"smem stage {s}" and kind == half)
            assert all(a[1] <= b[0] + 1e-9 for a, b in zip(held, held[1:]))


def test_ping_pong_keeps_the_tensor_cores_busier_than_one_warpgroup():
    _, one, _ = _simulate(4, 1, 2, 1.0, 0.5)
    _, two, _ = _simulate(4, 2, 2, 1.0, 0.5)
    assert one == pytest.approx(8 / 12.5) and two > 0.9 > one


def test_fa3_schedule_is_labelled():
    fig = figures.fa3_schedule()
    text = _texts(fig)
    for word in ("K0", "V0", "QK0", "PV0", "softmax"):
        assert word in text
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert "ping-pong" in fig.axes[1].get_title()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(blocks=0), ValueError, "blocks"), (dict(blocks=2.0), TypeError, "blocks"),
    (dict(stages=5), ValueError, "stages"), (dict(softmax_fraction=0), ValueError, "softmax_fraction"),
    (dict(load_time="1"), TypeError, "load_time"), (dict(blocks=True), TypeError, "blocks"),
])
def test_fa3_schedule_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        figures.fa3_schedule(**kwargs)
