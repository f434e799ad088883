"""Every Triton kernel compiles as Triton's JIT specialises it when an integer argument is 1.

Triton's JIT turns an integer argument equal to 1 into a compile-time constant (a Python ``int`` inside
the kernel, not a tensor), so ``B.to(tl.int64)`` compiles for B = 2 and fails for B = 1 with
"'int' object has no attribute 'to'". The interpreter never specialises, and the compile report leaves
lengths and head counts general, so neither saw it: the first real GPU run (an H200, 2026-11-26,
triton 3.6.0) found it in decode's split kernel at batch size 1, the commonest decode of all.

Here each kernel is cross-compiled for sm_90 with every integer scalar set to the constant 1 (batch,
heads, lengths, head dim, strides: all at once; the TMA kernels' strides stay general, as
the TMA path is taken only for strides that are multiples of 16 bytes), by every Triton version flashlib is tested with
(versions.TESTED; the others are installed beside this one by triton_versions.ensure, as for the
version matrix) in a child process in compile mode (this process interprets). No GPU is needed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, need_module

need_module("triton")
from flashlib.kernels.triton import versions# noqa: E402
from flashlib.tools import triton_versions  # noqa: E402

_CHILD = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashlib.tools import compile_report as cr
from flashlib.kernels.triton import versions
out = {}
for spec, signature, constexprs, cfg in cr._triton_jobs("sm_90", "fp16"):
    sig = dict(signature)
    # The TMA kernels' strides are multiples of 16 bytes (their launcher falls back otherwise): never 1.
    ones = {n: 1 for n, t in sig.items() if t in ("i32", "i64")
            and not (cr._is_tma(spec) and n.startswith("stride"))}
    sig.update({n: "constexpr" for n in ones})
    if versions.astsource_takes_attrs_dict(triton.__version__):
        src = ASTSource(spec.fn, sig, {**constexprs, **ones}, {})
    else:                                          # triton <= 3.2: equal_to_1 in an AttrsDescriptor
        from triton.backends.compiler import AttrsDescriptor
        idx = [i for i, n in enumerate(spec.fn.arg_names) if n in ones]
        attrs = AttrsDescriptor.from_dict({"arg_properties": {"tt.equal_to": idx}, "cls": "AttrsDescriptor"})
        src = ASTSource(spec.fn, {n: t for n, t in signature.items() if t != "constexpr"}, constexprs, attrs)
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        out[spec.name] = None
    except Exception as exc:
        out[spec.name] = f"{type(exc).__name__}: {' | '.join(str(exc).strip().splitlines()[-6:])[:600]}"
print("RESULT" + json.dumps(out))
"""


@pytest.mark.parametrize("version", versions.TESTED)
def test_every_kernel_compiles_when_the_jit_makes_its_integers_the_constant_1(version):
    folder = triton_versions.ensure(version)          # None: the installed Triton
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_ALWAYS_COMPILE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(folder or ""), str(ROOT)])))
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert len(results) >= 4, results                  # forward, dK/dV, dQ, decode split (+ combine, TMA)
    failed = {name: err for name, err in results.items() if err}
    assert not failed, failed
