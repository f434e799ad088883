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


@pytest.mark.parametrize("device, error", [("gpu0", ValueError), ("cuda:x", ValueError), ("", ValueError),
                                           (-1, ValueError), (3.5, TypeError), (None, TypeError),
                                           (True, TypeError), (["cpu"], TypeError)])
def test_a_bad_device_is_refused_naming_device(device, error):
    """kernel_dtypes and device_facts refuse what names no device with the argument's name, not with torch's
    "Invalid device string" from deep inside; an int is a CUDA index, as in cuda_device."""
    for fn in (hardware.kernel_dtypes, hardware.device_facts):
        with pytest.raises(error, match=r"^device must "):
            fn(device)


def test_device_facts_takes_a_cuda_index(monkeypatch):
    monkeypatch.setitem(hardware._CUDA_DEVICES, 3, hardware.CudaDevice(3, "sm_75", 40, 65536))
    assert hardware.device_facts(3).arch == "sm_75" and hardware.kernel_dtypes(3) == ("float16", "float32")


@pytest.mark.parametrize("name", [["T4"], 4, None])
def test_get_refuses_a_name_that_is_not_a_str(name):
    with pytest.raises(TypeError, match="name must be a str naming a GPU"):
        hardware.get(name)
