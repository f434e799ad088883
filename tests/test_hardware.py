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
