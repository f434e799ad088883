"""flashlib.cuda.launch without a GPU: grids within CUDA's limits for any B x H."""
from __future__ import annotations

import pytest

import flashlib.cuda as fc
from flashlib.cuda import launch

torch = pytest.importorskip("torch")


def all_specs(b, h, hkv, nq, nk, d):
    """Every kernel's LaunchSpecs at one shape: v1, v2 (f16, bf16), decode split + combine (3 dtypes)."""
    specs = launch.v1_launch(b, h, hkv, nq, nk, d, 1.0, True)
    for dt in ("f16", "bf16"):
        specs += launch.v2_launch(b, h, hkv, nq, nk, d, 1.0, True, dt)
    for dt in ("f32", "f16", "bf16"):
        specs += launch.decode_launch(b, h, hkv, 1, nk, d, 1.0, False, 4, dt)
    return specs


# B x H = 131072 (above 65,535 in either factor) and B = 100,000 sequences of 16 tokens.
@pytest.mark.parametrize("b, h, hkv, n, d", [(131072, 1, 1, 16, 64), (1024, 128, 8, 300, 128),
                                             (100000, 1, 1, 16, 64), (1, 131072, 1, 2, 16)])
def test_every_grid_is_within_cuda_limits(b, h, hkv, n, d):
    specs = all_specs(b, h, hkv, n, n, d)
    assert {s.kernel for s in specs} == {s.kernel for _, s in fc.compile_configs()}
    for s in specs:
        x, y, z = s.grid
        assert 1 <= x <= launch.GRID_X_MAX and 1 <= y <= launch.GRID_YZ_MAX and 1 <= z <= launch.GRID_YZ_MAX, s
        bx, by, bz = s.block
        assert bx * by * bz <= 1024
    tiles = {"fa2_fwd_v1_f32": -(-n // launch.v1_tile(d)[0]), "fa2_fwd_v2_f16": -(-n // launch.v2_tile(d)[0])}
    tiles["fa2_fwd_v2_bf16"] = tiles["fa2_fwd_v2_f16"]
    for s in specs:                                      # one block per (tile | split | row, head, batch)
        per_bh = tiles.get(s.kernel, 4 if "split" in s.kernel else 1)
        assert s.grid == (per_bh * h * b, 1, 1), s


def test_a_grid_beyond_cudas_limit_is_a_value_error():
    assert launch.flat_grid(3, 5, 7) == (105, 1, 1)
    with pytest.raises(ValueError, match="outside CUDA's grid limit"):
        launch.flat_grid(2 ** 16, 2 ** 16)
    with pytest.raises(ValueError, match="outside CUDA's grid limit"):
        launch.decode_launch(2 ** 20, 64, 8, 1, 10, 64, 1.0, False, 2 ** 12, "f16")
