# spec.py — each Triton kernel described once: arguments, constexprs, grid, shared-memory estimate.
# Changed from writing a kernel's signature three times (its launcher's positional call, the config
#   tables' shared-memory estimate, the compile report's hand-made signature), where changing a
#   kernel's arguments silently broke the compile report: a KernelSpec beside each kernel, checked
#   against the kernel's real parameters when the module is imported, and read by
#   * the launcher: KernelSpec.launch takes the arguments by name and puts them in order, strides
#     included, with the grid and the block constexprs of its config;
#   * configs.arch_candidates (which configs fit an architecture's shared memory);
#   * flashlib.tools.compile_report (the signature, constexprs and config it compiles).
#   A launch is host work on every call, so the spec works out its layout once: at construction, one
#   C-level getter (operator.itemgetter) per group of arguments; per set of argument names a launcher
#   passes, the missing/unknown check, done on its first launch and remembered (its clear TypeError
#   still comes, from the first launch that passes a wrong set). The per-device config candidates are
#   cached on the spec too (configs._device_candidates).
#   Threads: Triton's interpreter keeps the launch it is running in module-level state (the grid,
#   the program ids), so two interpreted launches at once corrupt each other ("x >= grid_dim[0]",
#   "Did you forget to add @triton.jit?", or a silently wrong answer). Every interpreted launch
#   therefore holds one process-wide lock (_INTERPRETED_LAUNCH); compiled GPU launches take none.
#   NumPy's RuntimeWarnings are silenced inside an interpreted launch: the interpreter computes with
#   NumPy, which warns on NaN inputs ("All-NaN slice encountered"), and where warnings are errors
#   (pytest's filterwarnings, python -W error) that turned a NaN answer into an InterpreterError. The
#   kernels' own NaN rule decides what a NaN input gives (flashlib.testing.reference_gqa states it).
# Idea: flashlib.kernels.cuda.launch.LaunchSpec, which does the same for the CUDA kernels.
# Limits: arguments come in four groups, in this order: pointers, the (batch, head, row) strides of
#   some of them (named stride_<x>b, stride_<x>h, stride_<x>n), scalars, constexprs.
# Run: fa2_fwd.SPEC.arg_names; flashlib.tools.compile_report.triton_specs() lists every kernel's.
"""KernelSpec: what a Triton kernel takes and how it is launched, for its launcher, configs and the
compile report.  Explained in: notebooks/07_triton."""
from __future__ import annotations

import inspect
import operator
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable

from . import INTERPRET

__all__ = ["KernelSpec", "staged_bytes"]

POINTER_TYPES = ("in", "fp32", "i32")     # "in": the inputs' dtype (fp16, bf16 or fp32)
SCALAR_TYPES = ("i32", "fp32")
# Held by every interpreted launch (the interpreter is not thread-safe); None when Triton compiles.
_INTERPRETED_LAUNCH = threading.Lock() if INTERPRET else None


def _getter(names: tuple[str, ...]) -> Callable[[dict], tuple]:
    """A function of a dict returning the tuple of its values at ``names`` (C-level for 2 or more)."""
    if len(names) >= 2:
        return operator.itemgetter(*names)
    return (lambda d: (d[names[0]],)) if names else (lambda d: ())


def staged_bytes(cfg, elem_bytes: int, *, resident: int, streamed: int) -> int:
    """Shared-memory bytes of a program's tiles: ``resident`` elements once, ``streamed`` elements
    once per pipeline stage (num_stages, at least 1).

    Explained in: notebooks/07_triton.

    Tested in: tests/kernels/triton/test_triton_spec.py.
    """
    return (resident + max(1, cfg.num_stages) * streamed) * elem_bytes


@dataclass(frozen=True)
class KernelSpec:
    """One Triton kernel's interface, written once beside it.

    ``pointers``: tensor arguments in order, each with its element type ("in": the inputs' dtype).
    ``strides``: the pointers whose (batch, head, row) strides follow, in order.
    ``scalars``: then the scalar arguments, "i32" or "fp32". ``constexprs``: then the compile-time ones.
    ``grid``: the launch grid from the arguments' values (a dict by name). ``config``: the kernel's key
    in :mod:`flashlib.kernels.triton.configs`' tables, or None with ``fixed``, the one config it always
    runs with. ``smem``: ``(cfg, block_d, elem_bytes) -> bytes`` of the tiles it stages (configs prunes
    by it). ``uses_dot``: it has a tl.dot (tensor cores on sm_80+). Host-side caches, not part of its
    identity: the argument-name sets :meth:`launch` has checked, and configs' per-device candidates.
    
    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_spec.py and tests/kernels/triton/test_triton_host.py.
    """
    name: str
    fn: object
    pointers: dict[str, str]
    strides: tuple[str, ...]
    scalars: dict[str, str]
    constexprs: tuple[str, ...]
    grid: Callable[[dict], tuple]
    config: str | None = None
    fixed: object = None
    smem: Callable | None = None
    uses_dot: bool = True
    runtime_args: tuple[str, ...] = field(init=False, repr=False)
    # Host-side caches, filled on first use (compare=False: not part of the spec's identity).
    _checked: dict = field(init=False, repr=False, compare=False, default_factory=dict)   # names -> blocks
    _candidates: dict = field(init=False, repr=False, compare=False, default_factory=dict)  # configs' cache

    def __post_init__(self):
        bad = {n: t for n, t in self.pointers.items() if t not in POINTER_TYPES}
        bad.update({n: t for n, t in self.scalars.items() if t not in SCALAR_TYPES})
        if bad:
            raise ValueError(f"{self.name}: argument types must be {POINTER_TYPES} (pointers) or "
                             f"{SCALAR_TYPES} (scalars), got {bad}")
        if (self.config is None) == (self.fixed is None):
            raise ValueError(f"{self.name}: give exactly one of config (a table key) and fixed (a Config)")
        strides = tuple(f"stride_{p.lower()}{axis}" for p in self.strides for axis in "bhn")
        object.__setattr__(self, "runtime_args", (*self.pointers, *strides, *self.scalars))
        self.check_signature()
        # launch's getters: pointers, the tensors whose strides follow, scalars, constexprs.
        for name, names in (("_pointers", tuple(self.pointers)), ("_strided", self.strides),
                            ("_scalars", tuple(self.scalars)), ("_constexprs", self.constexprs)):
            object.__setattr__(self, name, _getter(names))

    @property
    def arg_names(self) -> tuple[str, ...]:
        """Every argument of the kernel, in its order."""
        return (*self.runtime_args, *self.constexprs)

    def check_signature(self) -> None:
        """Raise ValueError unless the kernel's real parameters are :attr:`arg_names`, with exactly
        :attr:`constexprs` annotated ``tl.constexpr``."""
        params = inspect.signature(self.fn.fn).parameters
        real = tuple(params)
        real_constexprs = tuple(n for n, p in params.items() if "constexpr" in str(p.annotation))
        if real != self.arg_names or real_constexprs != self.constexprs:
            raise ValueError(f"{self.name}: the spec says arguments {self.arg_names} with constexprs "
                             f"{self.constexprs}, the kernel {self.fn.fn.__name__} has {real} with "
                             f"constexprs {real_constexprs}")

    def signature(self, dtype: str) -> dict[str, str]:
        """Triton's compile signature (``{name: "*fp16" | "i32" | "fp32" | "constexpr"}``) for inputs
        of ``dtype`` (e.g. "fp16"), as flashlib.tools.compile_report compiles the kernel."""
        sig = {n: "*" + (dtype if t == "in" else t) for n, t in self.pointers.items()}
        sig.update({n: "i32" for n in self.runtime_args[len(self.pointers):] if n not in self.scalars})
        sig.update(self.scalars)
        sig.update({n: "constexpr" for n in self.constexprs})
        return sig

    def block_constexprs(self, cfg) -> dict:
        """The constexprs a config sets: BLOCK_M and BLOCK_N, where the kernel has them."""
        return {n: v for n, v in (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n)) if n in self.constexprs}

    def launch(self, cfg=None, **values):
        """Launch the kernel with ``cfg`` (None: ``fixed``) and the arguments by name, strides left out:
        they are read from the pointers' tensors. BLOCK_M/BLOCK_N come from ``cfg`` unless given.
        TypeError naming the missing and unknown arguments if the names are not the kernel's."""
        cfg = self.fixed if cfg is None else cfg
        if cfg is None:
            raise TypeError(f"{self.name}.launch: cfg is required (a configs.Config from the {self.config!r} "
                            "tables: use configs.launch)")
        names = tuple(values)
        blocks = self._checked.get(names)
        if blocks is None:
            blocks = self._check_names(names)
        if blocks[0]:
            values["BLOCK_M"] = cfg.block_m
        if blocks[1]:
            values["BLOCK_N"] = cfg.block_n
        args = [*self._pointers(values)]
        for t in self._strided(values):
            args += t.stride()[:3]                        # (batch, head, row) strides
        args += self._scalars(values)
        kwargs = dict(zip(self.constexprs, self._constexprs(values)), num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages)
        return self._run(self.grid(values), args, kwargs)

    def _check_names(self, names: tuple[str, ...]) -> tuple[bool, bool]:
        """Check once per set of names a launcher passes (TypeError naming what is missing or
        unknown); remember which of BLOCK_M, BLOCK_N the config must supply."""
        blocks = tuple(n in self.constexprs and n not in names for n in ("BLOCK_M", "BLOCK_N"))
        given = {*names, *(n for n, b in zip(("BLOCK_M", "BLOCK_N"), blocks) if b),
                 *(n for n in self.runtime_args if n.startswith("stride_"))}
        missing = [n for n in self.arg_names if n not in given]
        extra = sorted(set(names) - set(self.arg_names))
        if missing or extra:
            raise TypeError(f"{self.name}.launch: missing arguments {missing}, unknown arguments {extra}")
        self._checked[names] = blocks
        return blocks

    def _run(self, grid, args, kwargs):
        lock = _INTERPRETED_LAUNCH
        if lock is None:                                  # compiled: launches are thread-safe
            self.fn[grid](*args, **kwargs)
            return
        with lock, warnings.catch_warnings():            # interpreted: one launch at a time, and
            warnings.simplefilter("ignore", RuntimeWarning)   # NumPy's NaN warnings are not ours
            self.fn[grid](*args, **kwargs)
