"""Kernel versions: one table per backend and role (forward, backward, decode), and one way to pick.

A :class:`Variant` is one kernel version, named as in its file name ("v1" for ``fa2_fwd_v1_scalar.cu``
or ``fa2_fwd_v1.py``, the Triton kernels' version 1), with ``supported(q, k, v[, do])``: None where it runs
these tensors, else why not. A :class:`Family` is a backend's table for one role, with its preference
order and the environment variable that sets its default. :meth:`Family.pick` chooses, the same way
for Triton and CUDA:

1. ``kernel=`` (the public API's argument) names a version: it runs, or a ValueError says why it
   cannot run these tensors;
2. else the family's environment variable (``FLASHLIB_TRITON_FWD=v4``), read on every call, names
   one: it runs where it is supported, and the default runs elsewhere (a variable is a default, not a
   demand: one setting serves a whole program whose calls differ);
3. else the first version of the preference order that supports the tensors.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Variant", "Family", "check_kernel", "check_decode_kernel"]


def _always(*tensors, **variants) -> None:
    return None


@dataclass(frozen=True)
class Variant:
    """One kernel version: its ``name`` (as in its file name), a one-line ``summary``, and
    ``supported(*tensors, **variants) -> str | None`` (None: it runs them, with the attention variants
    given as keywords, :func:`flashlib.validation.check_variants`; else the reason it cannot).

    Explained in: notebooks/07_triton.
    Tested in: tests/backends/test_variants.py.
    """
    name: str
    summary: str
    supported: Callable[..., str | None] = _always


@dataclass(frozen=True)
class Family:
    """A backend's kernel versions for one role, e.g. the Triton forwards {v1, v4}.

    ``variants``: in preference order (the first that supports the tensors is the default).
    ``env``: the environment variable that names a default version, or None. ``aliases``: other
    names a variable may use for a version (``tma`` for the TMA kernels, their name before versions
    were in file names).

    Explained in: notebooks/07_triton.
    Tested in: tests/backends/test_variants.py.
    """
    role: str
    variants: tuple[Variant, ...]
    env: str | None = None
    aliases: dict = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    def get(self, name: str, source: str = "kernel") -> Variant:
        """The variant called ``name`` (or an alias of it); ValueError naming ``source`` otherwise."""
        name = self.aliases.get(name, name)
        for v in self.variants:
            if v.name == name:
                return v
        also = f" or an alias {tuple(self.aliases)}" if self.aliases else ""
        raise ValueError(f"{source} must be one of {self.names}{also} ({self.role}), got {name!r}")

    def pick(self, wanted: str | None, *tensors, **variants) -> Variant:
        """The version that runs ``tensors``: ``wanted`` (the caller's ``kernel=``), else the
        environment's default where it applies, else the first in preference order that supports
        them (see the module's docstring); ``variants``: the attention variants the call uses.

        Explained in: notebooks/07_triton.
        Tested in: tests/backends/test_variants.py.
        """
        if wanted is not None:
            chosen = self.get(wanted)
            why = chosen.supported(*tensors, **variants)
            if why is not None:
                raise ValueError(f"kernel={wanted!r} ({self.role}) cannot run these inputs: {why}")
            return chosen
        named = os.environ.get(self.env) if self.env else None
        if named is not None:
            chosen = self.get(named, source=self.env)
            if chosen.supported(*tensors, **variants) is None:
                return chosen
        for chosen in self.variants:
            if chosen.supported(*tensors, **variants) is None:
                return chosen
        raise ValueError(f"no {self.role} kernel runs these inputs: " + "; ".join(
            f"{v.name}: {v.supported(*tensors, **variants)}" for v in self.variants))

    def check_env(self) -> None:
        """ValueError if the environment variable names no version (checked before any kernel runs)."""
        named = os.environ.get(self.env) if self.env else None
        if named is not None:
            self.get(named, source=self.env)


def check_kernel(kernel, backend: str, families: dict) -> tuple:
    """The public API's ``kernel=`` checked against a backend's tables: ``(forward, backward)`` names
    (each None or a name in ``families``' table for that role). ``kernel`` is None, a str (the
    forward's version), or a pair (forward, backward). TypeError/ValueError naming the argument.

    Explained in: notebooks/07_triton.
    Tested in: tests/backends/test_variants.py.
    """
    if kernel is None:
        return None, None
    pair = (kernel, None) if isinstance(kernel, str) else kernel
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or \
            not all(k is None or isinstance(k, str) for k in pair):
        raise TypeError(f"kernel must be None, a version name (str) or a pair (forward, backward) "
                        f"of names or None, got {kernel!r}")
    for name, role in zip(pair, ("forward", "backward")):
        if name is None:
            continue
        if role not in families:
            raise ValueError(f"kernel: backend={backend!r} has one {role} and no versions to "
                             f"choose, got {name!r}")
        families[role].get(name)
    return tuple(pair)


def check_decode_kernel(kernel, backend: str, families: dict):
    """The public API's ``kernel=`` of :func:`flashlib.decode` checked against a backend's tables: None
    or a name in its decode table. TypeError/ValueError naming the argument.

    Explained in: notebooks/07_triton.
    Tested in: tests/backends/test_variants.py.
    """
    if kernel is None:
        return None
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be None or a version name (str), got {kernel!r}")
    if "decode" not in families:
        raise ValueError(f"kernel: backend={backend!r} has one decode and no versions to choose, "
                         f"got {kernel!r}")
    families["decode"].get(kernel)
    return kernel
