# tables.py — every Triton kernel's config candidates, by architecture: a view.
# What it is: each kernel keeps its own candidates beside its spec (fa2_fwd_v1.CONFIGS, fa2_bwd_v2.DKDV_CONFIGS
#   and DQ_CONFIGS, decode.SPLIT_CONFIGS: configs.Tables); retuning a kernel is an edit of that one
#   table. This module reads them back by architecture, for the compile report, the tests and the book,
#   which compare the kernels on one GPU at a time.
# Idea: FlashAttention-2's per-GPU tile choices, laid out as in its launch templates (one list per GPU).
# Limits: a view, built when imported: a table edited at run time is not seen here (nor by a kernel
#   already launched: configs caches the candidates per device).
# Run: tables.table("sm_75", 2)["fwd"]; tables.CANDIDATES["bwd_dkdv"].
"""Every Triton kernel's config candidates by architecture (views of the tables beside each spec).

Explained in: notebooks/07_triton."""
from __future__ import annotations

from . import decode_v3 as decode, fa2_bwd_v2, fa2_fwd_v1

__all__ = ["SPECS", "table", "CANDIDATES", "SM90", "SM75", "FP32", "SM90_FP32", "SM75_FP32", "INTERPRETER"]

# The kernels with tables, in configs.KERNELS' order.
SPECS = (fa2_fwd_v1.SPEC, fa2_bwd_v2.DKDV_SPEC, fa2_bwd_v2.DQ_SPEC, decode.SPLIT_SPEC)


def table(arch: str, elem_bytes: int) -> dict[str, tuple]:
    """Every kernel's candidates for ``arch`` (e.g. "sm_75") and tiles of ``elem_bytes`` bytes per
    element (2: fp16/bf16, 4: fp32 tiles), ``{kernel: candidates}``.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    return {s.config: s.tables.for_arch(arch, elem_bytes) for s in SPECS}


CANDIDATES = table("sm_80", 2)        # sm_80-sm_89, fp16/bf16 tiles
SM90 = table("sm_90", 2)
SM75 = table("sm_75", 2)
FP32 = table("sm_80", 4)              # fp32 tiles (fp32 inputs, or fp16 loaded as fp32)
SM90_FP32 = table("sm_90", 4)
SM75_FP32 = table("sm_75", 4)
INTERPRETER = {s.config: s.tables.interpreter for s in SPECS}   # on a CPU
