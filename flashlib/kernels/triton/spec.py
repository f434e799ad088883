# spec.py — each Triton kernel described once, from its own signature, and launched one way.
# What it does: a KernelSpec beside each kernel reads the kernel's parameters (pointers, the strides
#   of some of them, scalars, constexprs) and owns the launch: KernelSpec.launch(config, **args) takes
#   the arguments by name, reads the strides from the tensors, sets UPCAST (configs.tile_plan), picks
#   the config (None: the device's candidates from the kernel's table, tried in order while Triton
#   raises OutOfResources; a Config: run as given, made configs.safe), sets the block constexprs and
#   launches, with Triton's scratch allocator where the kernel makes tensor descriptors (scratch=True).
#   A kernel's forward is then "allocate, build the arguments, launch". The compile report
#   (flashlib.tools.compile_report) compiles every kernel from the same spec.
#   Host cost: the argument layout is worked out once per spec, the name check once per set of names,
#   the candidates once per device (configs._device_candidates).
#   Threads: Triton's interpreter keeps the launch it runs in module-level state, so two interpreted
#   launches at once corrupt each other: every interpreted launch holds one process-wide lock.
#   NumPy's RuntimeWarnings are silenced inside an interpreted launch (the interpreter warns on NaN
#   inputs, which would turn a NaN answer into an error where warnings are errors); the kernels' NaN
#   rule decides what a NaN input gives (flashlib.testing.reference_gqa).
# Idea: flashlib.kernels.cuda.launch.LaunchSpec does the same for the CUDA kernels; Triton's
#   autotuner (`prune_configs_by`) prunes its configs by a rule as configs does here.
# Limits: a kernel's parameters come in four groups, in this order: pointers, the (batch, head, row)
#   strides of some of them (stride_<x>b, stride_<x>h, stride_<x>n for pointer X), scalars,
#   constexprs. Pointers are "in" (the inputs' dtype) and scalars "i32" unless `types` says "fp32"
#   or "i32".
# Run: fa2_fwd_v1.SPEC.arg_names; fa2_fwd_v1.SPEC.launch(None, Q=q, ...);
#   flashlib.tools.compile_report.triton_specs() lists every kernel's spec.
"""KernelSpec: what a Triton kernel takes and how it is launched, for its launcher, configs and the
compile report.  Explained in: notebooks/07_triton."""
from __future__ import annotations

import inspect
import operator
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from triton.runtime.errors import OutOfResources

from . import INTERPRET, configs

__all__ = ["KernelSpec", "staged_bytes"]

TYPES = ("in", "fp32", "i32")        # "in": the inputs' dtype (fp16, bf16 or fp32)
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


def _layout(name: str, fn, types: dict) -> tuple:
    """``(pointers, strides, scalars, constexprs)`` read from the kernel's own signature: the
    parameters before the first ``stride_`` one are pointers, ``stride_<x>b, stride_<x>h,
    stride_<x>n`` are the (batch, head, row) strides of pointer X, the others until the first
    ``tl.constexpr`` are scalars, and the ``tl.constexpr`` ones come last. Types are "in" (pointers)
    and "i32" (scalars) unless ``types`` names another."""
    params = inspect.signature(fn.fn).parameters
    names = tuple(params)
    constexprs = tuple(n for n, p in params.items() if "constexpr" in str(p.annotation))
    runtime = names[:len(names) - len(constexprs)]
    first = next((i for i, n in enumerate(runtime) if n.startswith("stride_")), len(runtime))
    pointers = runtime[:first]
    owners = {p.lower(): p for p in pointers}
    strides, i = [], first
    while i < len(runtime) and runtime[i].startswith("stride_"):
        owner = owners.get(runtime[i][len("stride_"):-1])
        if owner is None or runtime[i:i + 3] != tuple(f"stride_{owner.lower()}{a}" for a in "bhn"):
            raise ValueError(f"{name}: strides come as stride_<x>b, stride_<x>h, stride_<x>n of a "
                             f"pointer <X> {pointers}, got {runtime[i:i + 3]}")
        strides.append(owner)
        i += 3
    scalars = runtime[i:]
    if names[len(runtime):] != constexprs or any(n.startswith("stride_") for n in scalars):
        raise ValueError(f"{name}: the kernel's parameters must come as pointers, strides, scalars, "
                         f"then constexprs; {fn.fn.__name__} has {names}")
    unknown = {n: t for n, t in types.items() if n not in runtime or t not in TYPES}
    if unknown:
        raise ValueError(f"{name}: types must name pointers or scalars of the kernel, each one of "
                         f"{TYPES}; got {unknown}")
    defaults = {n: params[n].default for n in constexprs if params[n].default is not params[n].empty}
    return ({p: types.get(p, "in") for p in pointers}, tuple(strides),
            {s: types.get(s, "i32") for s in scalars}, constexprs, defaults)


@dataclass(frozen=True)
class KernelSpec:
    """One Triton kernel and how it is launched, written once beside it.

    Its arguments are read from the kernel's signature (:func:`_layout`): ``pointers``, ``strides``
    (the pointers whose (batch, head, row) strides follow), ``scalars``, ``constexprs``. ``types``:
    the pointers and scalars that are not "in" (the inputs' dtype) or "i32", e.g. ``LSE="fp32"``.
    ``grid``: the launch grid from the arguments (a dict by name). ``config``: the kernel's name
    in :mod:`flashlib.kernels.triton.configs` (``configs.hazard`` and ``configs.refusal`` know it) with
    ``tables``, its :class:`configs.Tables` of candidates, written beside it; or None with ``fixed``,
    the one config it runs with. ``smem``: ``(cfg, block_d, elem_bytes) -> bytes`` of the tiles it stages (configs prunes
    by it). ``uses_dot``: it has a tl.dot. ``defaults``: the constexprs the kernel gives a default
    (``SOFTCAP: tl.constexpr = False``), which a caller may leave out. ``constants``: constexprs this spec fixes (its callers do
    not pass them). ``blocks``: ``(cfg, args) -> {constexpr: value}``, the constexprs a config sets
    (default: BLOCK_M, BLOCK_N where the kernel has them). ``scratch``: the kernel makes tensor
    descriptors on the device, which need Triton's global scratch allocator during the launch.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_spec.py and tests/kernels/triton/test_triton_host.py.
    """
    name: str
    fn: object
    grid: Callable[[dict], tuple]
    types: dict = field(default_factory=dict)
    config: str | None = None
    tables: object = None
    fixed: object = None
    smem: Callable | None = None
    uses_dot: bool = True
    constants: dict = field(default_factory=dict)
    blocks: Callable | None = None
    scratch: bool = False
    pointers: dict = field(init=False)
    strides: tuple = field(init=False)
    scalars: dict = field(init=False)
    constexprs: tuple = field(init=False)
    defaults: dict = field(init=False)
    runtime_args: tuple = field(init=False, repr=False)
    # Host-side caches, filled on first use (compare=False: not part of the spec's identity).
    _checked: dict = field(init=False, repr=False, compare=False, default_factory=dict)   # names -> plan
    _candidates: dict = field(init=False, repr=False, compare=False, default_factory=dict)  # configs' cache

    def __post_init__(self):
        if (self.config is None) == (self.fixed is None) or (self.config is None) != (self.tables is None):
            raise ValueError(f"{self.name}: give exactly one of config (its name, with its tables) and "
                             "fixed (a Config)")
        pointers, strides, scalars, constexprs, defaults = _layout(self.name, self.fn, self.types)
        for name, value in (("pointers", pointers), ("strides", strides), ("scalars", scalars),
                            ("constexprs", constexprs), ("defaults", defaults)):
            object.__setattr__(self, name, value)
        if not set(self.constants) <= set(constexprs):
            raise ValueError(f"{self.name}: constants must be constexprs of the kernel {constexprs}, "
                             f"got {sorted(self.constants)}")
        names = tuple(f"stride_{p.lower()}{axis}" for p in strides for axis in "bhn")
        object.__setattr__(self, "runtime_args", (*pointers, *names, *scalars))
        # launch's getters: pointers, the tensors whose strides follow, scalars, constexprs.
        for name, keys in (("_pointers", tuple(pointers)), ("_strided", strides),
                           ("_scalars", tuple(scalars)), ("_constexprs", constexprs)):
            object.__setattr__(self, name, _getter(keys))

    @property
    def arg_names(self) -> tuple[str, ...]:
        """Every argument of the kernel, in its order."""
        return (*self.runtime_args, *self.constexprs)

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
        return {n: v for n, v in (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n))
                if n in self.constexprs}

    def launch(self, config=None, **args):
        """Launch the kernel on the arguments by name. Strides are left out
        (read from the pointers' tensors), and so is UPCAST where the kernel
        has it (:func:`configs.tile_plan`).

        ``config``: None lets the device's table choose
        (:func:`configs.candidates`), trying the next candidate while Triton
        raises OutOfResources (more shared memory or registers than the GPU
        has: the estimate was wrong). A :class:`configs.Config` runs as given,
        made :func:`configs.safe`, a None block taken from the table's first
        choice. A kernel with a ``fixed`` config runs that. TypeError naming
        the missing and unknown arguments if the names are not the kernel's.
        """
        names = tuple(args)
        plan = self._checked.get(names)
        if plan is None:
            plan = self._check_names(names)
        first, set_upcast, config_blocks, defaults = plan
        tensor = args[first]
        for n in defaults:          # constexprs left at the kernel's default
            args[n] = self.defaults[n]
        if set_upcast:              # fp32 tiles where 16-bit ones fail
            args["UPCAST"], elem_bytes = configs.tile_plan(tensor)
        elif self.fixed is None:
            elem_bytes = configs.tile_plan(tensor)[1]
        if self.fixed is not None:
            candidates = (self.fixed,)
        else:
            candidates = configs.candidates(self, tensor.device,
                                            args["BLOCK_D"], elem_bytes, config)
        if self.constants:
            args.update(self.constants)
        last = candidates[-1]
        for cfg in candidates:
            if self.blocks is not None:
                args.update(self.blocks(cfg, args))
            else:
                for n in config_blocks:
                    args[n] = cfg.block_m if n == "BLOCK_M" else cfg.block_n
            values = [*self._pointers(args)]
            for t in self._strided(args):
                values += t.stride()[:3]    # (batch, head, row) strides
            values += self._scalars(args)
            kwargs = dict(zip(self.constexprs, self._constexprs(args)),
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            try:
                return self._run(self.grid(args), values, kwargs)
            except OutOfResources:
                if cfg is last:
                    raise

    def _check_names(self, names: tuple[str, ...]) -> tuple:
        """Check once per set of names a launcher passes (TypeError naming what is missing or
        unknown), and remember the launch's plan for them: the first pointer (its device and dtype
        choose the config), whether launch sets UPCAST, which of BLOCK_M, BLOCK_N the config sets,
        and the constexprs left at the kernel's defaults."""
        set_upcast = "UPCAST" in self.constexprs and "UPCAST" not in names
        config_blocks = tuple(n for n in ("BLOCK_M", "BLOCK_N") if n in self.constexprs and n not in names)
        made = {n for n in self.runtime_args if n.startswith("stride_")} | set(self.constants)
        defaults = tuple(n for n in self.defaults if n not in names and n not in self.constants)
        made |= set(config_blocks) | set(defaults) | ({"UPCAST"} if set_upcast else set())
        missing = [n for n in self.arg_names if n not in names and n not in made]
        extra = sorted(set(names) - set(self.arg_names) | (set(names) & set(self.constants)))
        if missing or extra:
            raise TypeError(f"{self.name}.launch: missing arguments {missing}, unknown arguments {extra}")
        plan = (next(iter(self.pointers)), set_upcast, config_blocks, defaults)
        self._checked[names] = plan
        return plan

    def _run(self, grid, args, kwargs):
        """The launch itself: ``fn[grid](*args, **kwargs)``, under the interpreter's lock where Triton
        interprets, and with Triton's scratch allocator where the spec says (``scratch``)."""
        token = _ALLOCATOR.set(_scratch) if self.scratch else None
        try:
            lock = _INTERPRETED_LAUNCH
            if lock is None:                              # compiled: launches are thread-safe
                self.fn[grid](*args, **kwargs)
                return
            with lock, warnings.catch_warnings():        # interpreted: one launch at a time, and
                warnings.simplefilter("ignore", RuntimeWarning)   # NumPy's NaN warnings are not ours
                self.fn[grid](*args, **kwargs)
        finally:
            if token is not None:
                _ALLOCATOR.reset(token)


def _scratch(size: int, alignment: int, stream):
    """Triton's allocator protocol: global scratch for the tensor descriptors each program writes."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _allocator_var():
    """Triton's allocator ContextVar (triton.set_allocator sets it; triton >= 3.4, which the
    descriptor kernels need), or a stand-in that refuses where this Triton has none."""
    try:
        from triton.runtime._allocation import _allocator
        return _allocator
    except ImportError:                                   # pragma: no cover - triton < 3.4
        return None


_ALLOCATOR = _allocator_var()
