# configs.py — how each Triton kernel's block sizes, warps and pipeline stages are chosen, per
#   architecture.
# Changed from "one config for all" (Triton's tutorial): each kernel keeps a short ordered list of
#   candidates per architecture beside its spec, from the largest tile down (a Tables:
#   fa2_fwd_v1.CONFIGS, fa2_bwd_v2.DKDV_CONFIGS and DQ_CONFIGS, decode.SPLIT_CONFIGS;
#   flashlib.kernels.triton.tables lays them out by architecture). The first whose shared-memory
#   estimate fits the architecture's per-block limit (flashlib.hardware.ARCH_SMEM_LIMIT: T4 64 KB,
#   sm_86/89 99 KB, A100 163 KB, H100 227 KB) is used, and KernelSpec.launch takes the next while
#   Triton raises OutOfResources. On sm_75 Triton's tl.dot runs on CUDA cores (FFMA) with a large
#   stack, so sm_75 gets its own, smaller tiles. fp32 tiles (fp32 inputs, or fp16 loaded as fp32 on
#   a T4 with triton 3.3: upcast_tiles, the one place that decides the kernels' UPCAST) get their
#   own candidates, chosen by elem_bytes == 4: on the fp16 ones ptxas spilled 25-66 KB per thread on
#   sm_80/sm_90 and the T4 ran out of shared memory at d = 256. In the interpreter, small blocks so
#   that short test sequences still cross several blocks (the masks are what tests must reach).
# Idea: FlashAttention-2's per-GPU tile choices; pruning by shared memory as Triton's autotuner
#   `prune_configs_by` hook does (we choose by rule, not by timing).
# Limits: the estimate is the tiles' bytes (Q, and K/V times the pipeline depth), the spec's `smem`
#   (flashlib.kernels.triton.spec): the functions that choose a config take that spec (its `config`
#   names the kernel, its `tables` holds the candidates); the compile report
#   (flashlib.tools.compile_report) measures the real figure and the tests check it fits.
#   Correctness before speed: hazard refuses the class of configs a real H100 showed wrong (the
#   rule, below) in every table, and safe runs a caller's config of that class un-pipelined. Only
#   the sm_90 fp16 backward pair has run on a GPU (right and deterministic on an H100); the other
#   candidates, the fp32 ones included, come from cross-compiles (no spills, shared memory that
#   fits). The GPU tier forces each fp16 backward candidate of the GPU it runs on; fp32 tiles run
#   there only as each kernel's first choice.
# Run: pick_config(fa2_fwd_v1.SPEC, q.device, block_d=128, elem_bytes=2); upcast_tiles("float16",
#   "sm_75", "3.3.1") -> True.
"""Per-architecture kernel configurations.  Explained in: notebooks/07_triton."""
from __future__ import annotations

from dataclasses import dataclass

from ... import hardware as _hardware
from ...hardware import ARCH_SMEM_LIMIT, cuda_device, device_facts
from . import versions

__all__ = ["Config", "Tables", "KERNELS", "hazard", "safe", "arch_config",
           "arch_candidates", "pick_config", "candidates", "device_arch",
           "check_dtype_arch", "upcast_tiles", "tile_plan", "refusal"]

# On sm_75 Triton stages both operands of its FFMA dot through shared memory: the compile report
# measured 1.2-1.9x the tile bytes of a KernelSpec's smem estimate there for fp16 tiles (at or below it
# on sm_80+). Tiles loaded as fp32 (fp32 inputs, or UPCAST) measured at or below their estimate with
# elem_bytes 4 (triton 3.9, 2026-11-26: the SM75_FP32 table below), so the factor is for 2-byte tiles.
SM75_SMEM_FACTOR = 2


@dataclass(frozen=True)
class Config:
    """One launch configuration: query rows per program, keys per step, warps, pipeline stages.
    A caller's choice may leave block_m or block_n None: the table's first candidate fills it
    (:func:`candidates`).

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    block_m: int | None
    block_n: int | None
    num_warps: int = 4
    num_stages: int = 2

    def __str__(self) -> str:
        return f"M{self.block_m}-N{self.block_n}-w{self.num_warps}-s{self.num_stages}"


# The kernels that need a config: FA2 forward, the two backward kernels, the decode split kernel.
# (The D preprocess and the decode combine are elementwise/reduction kernels with fixed small blocks.)
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "decode")

# The rule (hazard, safe): the dK/dV kernel never runs pipelined (num_stages >= 2) with a query step
# below 64 beside a key block of 64 or more (block_m < 64 <= block_n). On an H100 (sm_90, triton 3.6,
# 2026-11-23) those configs gave a wrong, non-deterministic dK: Triton's pipeliner gives a Q tile that
# feeds both an mma.sync and a wgmma one shared-memory buffer, and the next copy overwrites it while
# dK's wgmma still reads it (triton-lang/triton issue 6691). No table below offers the class, on any
# architecture; safe() runs a caller's config in it with num_stages = 1. Only sm_90 ran on a GPU; the
# other tables come from cross-compiles, and the GPU tier checks them on their own GPUs.
# The investigation: notebooks/appendix_verification.

@dataclass(frozen=True)
class Tables:
    """One kernel's config candidates, largest tile first, written beside its KernelSpec (e.g.
    ``fa2_fwd_v1.CONFIGS``). ``sm80``: sm_80-sm_89 with 2-byte (fp16/bf16) tiles; ``sm90``: sm_90 (None:
    sm80's); ``sm75``: the T4, where tl.dot runs on CUDA cores (FFMA): small tiles and 8 warps keep the
    fp32 partial products in registers. ``fp32`` (sm_80+), ``sm90_fp32`` (None: fp32's) and
    ``sm75_fp32``: tiles loaded as fp32 (fp32 inputs, or fp16 where :func:`upcast_tiles` says so), on
    CUDA cores, so small tiles that do not spill. ``interpreter``: the one config on a CPU, small so
    that short test sequences still cross several blocks. How they were chosen: this file's header
    and notebooks/appendix_verification.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    sm80: tuple
    sm75: tuple
    fp32: tuple
    sm75_fp32: tuple
    interpreter: Config
    sm90: tuple | None = None
    sm90_fp32: tuple | None = None

    def for_arch(self, arch: str, elem_bytes: int) -> tuple:
        """The candidates for ``arch`` (e.g. "sm_75") and tiles of ``elem_bytes`` (2 or 4) bytes."""
        if elem_bytes not in (2, 4):
            raise ValueError(f"elem_bytes must be 2 (fp16/bf16 tiles) or 4 (fp32 tiles), got {elem_bytes!r}")
        cc = _cc(arch)
        if elem_bytes == 4:
            return self.sm75_fp32 if cc < 80 else (self.sm90_fp32 or self.fp32) if cc >= 90 else self.fp32
        return self.sm75 if cc < 80 else (self.sm90 or self.sm80) if cc >= 90 else self.sm80


def hazard(kernel: str, cfg: Config) -> str | None:
    """Why ``cfg`` must not run ``kernel`` on a GPU, or None. The one class
    shown wrong on a real GPU: the dK/dV kernel pipelined (num_stages >= 2)
    with block_m < 64 <= block_n (see above).

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if not isinstance(cfg, Config):
        raise TypeError("cfg must be a flashlib.kernels.triton.configs.Config, "
                        f"got {type(cfg).__name__}")
    pipelined = cfg.num_stages >= 2
    if kernel == "bwd_dkdv" and pipelined and cfg.block_m < 64 <= cfg.block_n:
        return (f"bwd_dkdv {cfg}: pipelined with a query step < 64 beside a "
                "key block >= 64 gave a wrong, non-deterministic dK on an H100")
    return None


def safe(kernel: str, cfg: Config) -> Config:
    """``cfg``, or its un-pipelined twin (num_stages = 1) if :func:`hazard`
    refuses it.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    if hazard(kernel, cfg) is None:
        return cfg
    return Config(cfg.block_m, cfg.block_n, cfg.num_warps, 1)


def _table_spec(kernel):
    """``kernel`` checked: the KernelSpec of a kernel that has a config table (e.g. fa2_fwd_v1.SPEC)."""
    if getattr(kernel, "config", None) not in KERNELS or getattr(kernel, "tables", None) is None:
        got = (f"the spec of {kernel.name}, which has a fixed config" if hasattr(kernel, "fixed")
               else f"{type(kernel).__name__} {kernel!r}")
        raise TypeError(f"kernel must be the KernelSpec of a kernel with a config table {KERNELS} "
                        f"(e.g. fa2_fwd_v1.SPEC), got {got}")
    return kernel


def _cc(arch: str) -> int:
    """The compute capability of ``arch`` as a number: "sm_90a" -> 90. ValueError naming ``arch`` if it
    is not of that form."""
    digits = arch.removeprefix("sm_").rstrip("a") if isinstance(arch, str) and arch.startswith("sm_") else ""
    if not digits.isdigit():
        raise ValueError(f"arch must be a CUDA architecture like 'sm_80' or 'sm_90a', got {arch!r}")
    return int(digits)


def _limit_bytes(arch: str) -> int:
    if arch in ARCH_SMEM_LIMIT:
        return ARCH_SMEM_LIMIT[arch] * 1024
    known = [a for a in ARCH_SMEM_LIMIT if _cc(a) <= _cc(arch)]   # nearest older architecture we know
    return ARCH_SMEM_LIMIT[max(known, key=_cc)] * 1024 if known else 48 * 1024


def arch_candidates(kernel, arch: str, block_d: int, elem_bytes: int, *,
                    limit: int | None = None) -> list[Config]:
    """The candidates of ``kernel``'s table (``kernel.config``) on ``arch`` whose shared-memory estimate
    (``kernel.smem``, written beside the kernel) fits, largest first — at least the smallest candidate,
    even if its estimate does not fit: the launch then says so.

    Explained in: notebooks/07_triton.

    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    spec = _table_spec(kernel)
    cc = _cc(arch)
    candidates = spec.tables.for_arch(arch, elem_bytes)
    factor = SM75_SMEM_FACTOR if cc < 80 and elem_bytes < 4 else 1
    limit = _limit_bytes(arch) if limit is None else limit
    fits = [c for c in candidates if factor * spec.smem(c, block_d, elem_bytes) <= limit]
    return fits or [candidates[-1]]


def arch_config(kernel, arch: str, block_d: int, elem_bytes: int, *, limit: int | None = None) -> Config:
    """The first candidate for ``kernel`` whose shared-memory estimate fits ``arch`` (e.g. "sm_80").

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    return arch_candidates(kernel, arch, block_d, elem_bytes, limit=limit)[0]


def device_arch(device) -> str:
    """``"sm_XY"`` of a CUDA device (asked of the driver once per device index:
    :func:`flashlib.hardware.cuda_device`).

    Explained in: notebooks/07_triton.
    Tested in: tests/gpu/test_compile_report_gpu.py.
    """
    return cuda_device(device).arch


def _device_candidates(kernel, device, block_d: int, elem_bytes: int) -> tuple[Config, ...]:
    """:func:`arch_candidates` for ``device`` (the interpreter's one config on a CPU), worked out once per
    (spec, device type and index, block_d, elem_bytes) and kept on the spec: a launch's hot path. (The
    tables are read on the first launch of each key: change them before launching, not after.)
    While a GPU is rehearsed (flashlib.hardware.rehearse), CPU tensors get that GPU's candidates."""
    # the GPU CPU tensors stand for (hardware.rehearsing(), read without a call: a launch's hot path)
    stand_in = None if device.type == "cuda" else _hardware._REHEARSAL
    key = (device.type, device.index, block_d, elem_bytes, stand_in)
    found = kernel._candidates.get(key)
    if found is None:
        if device.type != "cuda" and stand_in is None:
            found = (_table_spec(kernel).tables.interpreter,)
        else:
            facts = stand_in or cuda_device(device)     # the device's own shared-memory figure if known
            found = tuple(arch_candidates(kernel, facts.arch, block_d, elem_bytes, limit=facts.smem_optin))
        if device.type != "cuda" or device.index is not None:   # "cuda" alone follows current_device
            kernel._candidates[key] = found
    return found


def pick_config(kernel, device, block_d: int, elem_bytes: int) -> Config:
    """The config for ``kernel`` on ``device``: the interpreter's on CPU, else :func:`arch_config`.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    return _device_candidates(kernel, device, block_d, elem_bytes)[0]


def candidates(kernel, device, block_d: int, elem_bytes: int, config: Config | None = None) -> tuple:
    """The configs :meth:`KernelSpec.launch <flashlib.kernels.triton.spec.KernelSpec.launch>` tries,
    in order: the device's candidates (:func:`_device_candidates`) when ``config`` is None, else
    ``config`` alone, made :func:`safe`, a None block_m or block_n taken from the first candidate.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    found = _device_candidates(kernel, device, block_d, elem_bytes)
    if config is None:
        return found
    if config.block_m is None or config.block_n is None:
        first = found[0]
        config = Config(first.block_m if config.block_m is None else config.block_m,
                        first.block_n if config.block_n is None else config.block_n,
                        config.num_warps, config.num_stages)
    return (safe(kernel.config, config),)


def check_dtype_arch(dtype_name: str, arch: str, version=None) -> None:
    """Refuse bfloat16 before sm_80, on every Triton: such a GPU has no bfloat16 tensor-core
    instructions (sm_80 added them), so a bf16 kernel there could only compute on CUDA cores, and
    Triton up to 3.3 cannot even compile it (:func:`flashlib.kernels.triton.versions.bf16_compiles`;
    from 3.4 it compiles). flashlib's CUDA backend and torch's flash SDPA refuse it there too.
    ``dtype_name`` like "bfloat16", ``arch`` like "sm_75", ``version`` the Triton (None: installed),
    which only changes what the message says.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_configs.py.
    """
    if dtype_name == "bfloat16" and _cc(arch) < 80:
        v = versions.parse(version) if version is not None else versions.installed()
        t = "triton " + ".".join(map(str, v))
        compiles = (f"{t} compiles bfloat16 there for CUDA cores only" if versions.bf16_compiles(arch, v)
                    else f"{t} cannot compile bfloat16 there at all")
        raise ValueError(f"backend='triton': bfloat16 needs compute capability 8.0 (sm_80) or newer; this "
                         f"GPU is {arch} (e.g. a T4), which has no bfloat16 tensor cores ({compiles}). "
                         "flashlib refuses bfloat16 before sm_80 on every Triton, as torch's flash "
                         "attention does. Use float16 (or float32) on this GPU: "
                         "flashlib.hardware.kernel_dtypes(device) lists them.")


def upcast_tiles(dtype_name: str, arch: str | None, version=None, *, interpreting: bool = False) -> bool:
    """The kernels' UPCAST constexpr: whether they load their tiles as float32 before ``tl.dot``.
    The one place that decides it; every launcher asks :func:`tile_plan`, which asks this.

    True for bfloat16 in Triton's interpreter (``interpreting``; ``arch`` may be None then): its bf16
    ``tl.dot`` computes wrongly (triton 3.9). True on a GPU where fp16/bf16 tiles do not compile into
    ``tl.dot`` (:func:`flashlib.kernels.triton.versions.dot_needs_fp32_tiles`: sm_75 with triton
    3.3.x, "Unsupported conversion from f16 to f16"); fp32 tiles compile there. Else False (float32
    tiles are float32 already). ``version``: the Triton (None: the installed one).

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    if dtype_name not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"dtype_name must be 'float16', 'bfloat16' or 'float32', got {dtype_name!r}")
    if interpreting:
        return dtype_name == "bfloat16"
    return dtype_name != "float32" and versions.dot_needs_fp32_tiles(arch, version)


def refusal(kernel: str, arch: str, block_d: int, dtype_name: str, version=None) -> str | None:
    """Why ``kernel`` (a table key, e.g. "bwd_dkdv") cannot run on ``arch`` for ``dtype_name`` inputs at
    head-dim tile ``block_d`` with this Triton (``version``; None: installed), or None. Two cases are
    known, both the dK/dV kernel at block_d 256 on sm_75 (cross-compiled, the version matrix,
    2026-11-26), whose smallest tile (M16-N16, 1 to 8 warps, one stage) needs 66,560 B of shared memory
    against the T4's 65,536: with triton 3.3.x for fp16/bf16 inputs, whose tiles are loaded as fp32
    there (:func:`upcast_tiles`); and with triton <= 3.2 for fp32 inputs (3.4 and newer fit it in
    65,536 B). The message names the version and the fix.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    if kernel != "bwd_dkdv" or block_d <= 128 or _cc(arch) >= 80:
        return None
    v = versions.parse(version) if version is not None else versions.installed()
    fp32 = dtype_name == "float32"
    if (not fp32 and versions.dot_needs_fp32_tiles(arch, v)) or (fp32 and v[:2] <= (3, 2)):
        how = "on fp32 inputs" if fp32 else "only on fp32 tiles"
        return (f"backend='triton': the {dtype_name} backward at head dim > 128 does not fit a "
                f"{arch} GPU with triton {'.'.join(map(str, v))}: this Triton compiles its dK/dV kernel "
                f"there {how} into 66,560 bytes of shared memory (the GPU has 65,536). Upgrade Triton to "
                "3.4 or newer (pip install 'triton>=3.4', or a torch >= 2.8, which brings it); or use "
                f"{'float16' if fp32 else 'float32'} inputs or head dim <= 128.")
    return None


_PLANS: dict = {}


def tile_plan(q) -> tuple[bool, int]:
    """``(UPCAST, elem_bytes)`` for launching a kernel on ``q``'s dtype and device: UPCAST from
    :func:`upcast_tiles`, and the bytes per tile element the config choice budgets shared memory for
    (4 where the tiles are loaded as float32 on the GPU, else ``q.element_size()``). A CPU tensor is
    interpreted; while a GPU is rehearsed (:func:`flashlib.hardware.rehearse`) its budget is that
    GPU's. Worked out once per (dtype, device, rehearsal): a launch's hot path.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    device = q.device
    stand_in = None if device.type == "cuda" else _hardware._REHEARSAL      # hardware.rehearsing()
    key = (q.dtype, device.type, device.index, stand_in)
    plan = _PLANS.get(key)
    if plan is None:
        name = str(q.dtype).removeprefix("torch.")
        facts = device_facts(device)
        upcast = upcast_tiles(name, facts.arch if facts else None, interpreting=device.type != "cuda")
        on_gpu = facts is not None and upcast_tiles(name, facts.arch)   # the rehearsed GPU's rule too
        plan = (upcast, 4 if on_gpu else q.element_size())
        if device.type != "cuda" or device.index is not None:   # "cuda" alone follows current_device
            _PLANS[key] = plan
    return plan
