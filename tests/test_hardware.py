"""flashlib.hardware: the published GPU table and ridge points."""
import pytest

from flashlib import hardware


def test_hardware_table_and_ridge_points():
    t4 = hardware.get("T4")
    assert (t4.arch, t4.sms, t4.smem_per_block_kb) == ("sm_75", 40, 64)
    assert t4.ridge_flops_per_byte == pytest.approx(65e12 / 320e9)
    assert hardware.get("H100-SXM").ridge_flops_per_byte > hardware.get("A100-80GB").ridge_flops_per_byte
    assert set(hardware.ARCH_SMEM_LIMIT) == {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90"}
    with pytest.raises(ValueError, match="name must be one of"):
        hardware.get("V100")


def test_flat_programs_checks_cudas_grid_limit_and_its_arguments():
    import numpy as np

    from flashlib.hardware import CUDA_GRID_MAX, flat_programs
    assert flat_programs(3, np.int64(5), 7) == 105
    assert flat_programs(CUDA_GRID_MAX[0]) == CUDA_GRID_MAX[0]
    for counts in ((2**16, 2**15), (0, 4)):
        with pytest.raises(ValueError, match="outside CUDA's grid limit"):
            flat_programs(*counts)
    with pytest.raises(TypeError, match="counts must be integers"):
        flat_programs(3, 2.5)


def test_ridge_point_is_peak_flops_over_bandwidth():
    h100 = hardware.get("H100-SXM")
    assert hardware.ridge_point(h100.fp16_tflops, h100.bandwidth_gbs) == pytest.approx(989e12 / 3350e9)
    assert hardware.ridge_point(100.0, 1000.0) == pytest.approx(100.0)   # 1e14 FLOP/s over 1e12 B/s


@pytest.mark.parametrize("arch, want", [("sm_75", ("float16", "float32")),
                                        ("sm_80", ("float16", "bfloat16", "float32")),
                                        ("sm_90a", ("float16", "bfloat16", "float32"))])
def test_kernel_dtypes_leave_out_bfloat16_before_sm_80(arch, want, monkeypatch):
    """A GPU's facts where the driver's would be (cuda:3 is never asked): a T4 gets no bfloat16."""
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(hardware._CUDA_DEVICES, 3, hardware.CudaDevice(3, arch, 40, 65536))
    assert hardware.kernel_dtypes(torch.device("cuda", 3)) == want
    assert hardware.kernel_dtypes("cuda:3") == want
    assert hardware.kernel_dtypes("cpu") == ("float16", "bfloat16", "float32")   # the interpreter takes all
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in want)     # names of torch dtypes
