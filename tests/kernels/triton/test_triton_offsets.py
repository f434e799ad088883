"""Every Triton kernel computes its memory offsets in 64 bits (issue 20, finding 4).

A tensor of 2^31 elements or more (a decode cache of B = 72, Hkv = 8, Nmax = 32768, d = 128: 2.4e9
elements, 4.8 GB in fp16) is ordinary on an H100, and a 32-bit ``b * stride_b`` or ``rows * stride_n``
wraps there: silently wrong results or a fault that loses the CUDA context. The interpreter cannot
show it (NumPy computes the offsets in int64), so this test reads what the compiler is given: each
kernel of :func:`flashlib.tools.compile_report.triton_specs` is compiled for sm_80 in a child process
(Triton in compile mode, pointers and strides specialised divisible by 16 as the JIT does), and in its
TTIR every ``arith.muli`` that takes a stride argument — or NQ, NK, n_rows or D, which scale a
(batch·head) row index into LSE, D and the decode partials — must be an i64 multiplication. Operands
are traced back through the value-preserving ops (extsi, splat, broadcast, expand_dims) to the
kernel's arguments. The rule and its one exception live in :data:`EXEMPT`.

Before the offsets were widened (kit's "Offsets"), every kernel failed here: fa2_fwd's TTIR had
``arith.muli %6, %stride_qb : i32`` and 14 more 32-bit products of this kind, the 8 kernels 97.

The GPU-tier twin, tests/gpu/test_offsets_gpu.py, runs decode and attention on tensors past 2^31
elements. The compile is cached (``$FLASHLIB_CACHE_DIR/offsets-ttir``), keyed by the kernels' sources
and the Triton version.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT, require_module, require_tool

require_module("triton")

from flashlib.tools import toolchain  # noqa: E402
from flashlib.tools.compile_report import triton_specs  # noqa: E402

ARCH = "sm_80"
# Size arguments that scale a row index into a flat (B, H, NQ[, D]) buffer: LSE, D (delta), the decode
# partials. Every stride_* argument is checked too.
ROW_SCALES = ("NQ", "NK", "n_rows", "D")
# (kernel, frozenset of the two arguments) of the one product of two sizes that stays 32-bit: the decode
# split stacks a kv head's GROUP·NQ query rows into its row blocks; the rows are indices, not offsets, and
# must be < 2^31 (decode_v3.py's Limits).
EXEMPT = {("decode_split", frozenset({"GROUP", "NQ"}))}
# Value-preserving ops: a multiplication by their result is a multiplication by their operand.
_PASS_THROUGH = re.compile(r"^(arith\.extsi|tt\.splat|tt\.broadcast|tt\.expand_dims)\s+(%[\w.$-]+)")
_DEF = re.compile(r"^\s*(%[\w.$-]+)\s*=\s*(.*)$")
_MULI = re.compile(r"^arith\.muli\s+(%[\w.$-]+),\s*(%[\w.$-]+)\s*:\s*([^\s]+)")
_FUNC = re.compile(r"tt\.func\s+public\s+@\w+\((.*)\)\s*(?:attributes|\{)")

# The child: compile every kernel of the report's list for ARCH, print {name: TTIR} as JSON.
_CHILD = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashlib.kernels.triton import INTERPRET, configs, decode_v3 as decode, versions
from flashlib.tools.compile_report import triton_specs
assert not INTERPRET, "the TTIR child must run with TRITON_INTERPRET=0"
arch = sys.argv[1]
cc = int(arch.removeprefix("sm_"))
values = dict(CAUSAL=True, BLOCK_D=128, UPCAST=False, PRECISION="ieee", BLOCK_S=16, WARP_SPECIALIZE=False)
out = {}
for spec in triton_specs():
    cfg = spec.fixed if spec.config is None else configs.arch_config(spec, arch, 128, 2)
    consts = {**spec.defaults, **values, **spec.constants, **spec.block_constexprs(cfg)}
    if spec is decode.SPLIT_SPEC:
        consts["BLOCK_M"] = decode.split_block_m(cfg.block_m, 4, 1)
    sig = spec.signature("fp16")
    attrs = None
    if versions.astsource_takes_attrs_dict():
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(spec.fn.arg_names)
                 if sig[n].startswith("*") or n.startswith("stride") or n == "D"}
    src = ASTSource(spec.fn, sig, {n: consts[n] for n in spec.constexprs}, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    out[spec.name] = kernel.asm["ttir"]
print("OFFSETS-TTIR:" + json.dumps(out))
"""


def _arg_names(ttir: str) -> list[str]:
    """The SSA names of the kernel function's arguments, in order."""
    m = _FUNC.search(ttir)
    if m is None:
        raise ValueError("no `tt.func public @kernel(...)` in this TTIR")
    return re.findall(r"(%[\w.$-]+)\s*:", re.sub(r"loc\([^()]*(\([^()]*\))?[^()]*\)", "", m.group(1)))


def checked_products(ttir: str, arg_names) -> list[tuple[str, frozenset, str]]:
    """Every ``arith.muli`` of ``ttir`` one of whose operands is, through extsi/splat/broadcast/
    expand_dims, a kernel argument named stride_* or in :data:`ROW_SCALES`: ``(result type, the
    arguments both operands come from, the line)``. ``arg_names`` are the kernel's runtime arguments
    in order (the TTIR may name them %arg0...)."""
    ssa = _arg_names(ttir)
    if len(ssa) != len(arg_names):
        raise ValueError(f"the TTIR's function has {len(ssa)} arguments, the spec {len(arg_names)}")
    args = dict(zip(ssa, arg_names))
    defs: dict[str, list[str]] = {}
    for line in ttir.splitlines():
        m = _DEF.match(line)
        if m:                                   # a name may repeat in sibling regions: keep every def
            defs.setdefault(m.group(1), []).append(m.group(2).strip())

    def roots(value, depth=0) -> set[str]:
        if value in args:
            return {args[value]}
        found = set()
        for body in defs.get(value, ()):
            m = _PASS_THROUGH.match(body)
            if m and depth < 16:
                found |= roots(m.group(2), depth + 1)
        return found

    out = []
    for line in ttir.splitlines():
        m = _DEF.match(line)
        mul = _MULI.match(m.group(2).strip()) if m else None
        if mul is None:
            continue
        came_from = roots(mul.group(1)) | roots(mul.group(2))
        if any(n.startswith("stride_") or n in ROW_SCALES for n in came_from):
            out.append((mul.group(3), frozenset(came_from), line.strip()))
    return out


def narrow_offsets(kernel: str, ttir: str, arg_names) -> list[str]:
    """The lines of :func:`checked_products` not done in i64, less :data:`EXEMPT`'s."""
    bad = []
    for typ, came_from, line in checked_products(ttir, arg_names):
        if re.search(r"(^|x)i64>?$", typ):
            continue
        if (kernel, came_from) in EXEMPT:
            continue
        bad.append(line)
    return bad


def _source_key() -> str:
    h = hashlib.sha256(_CHILD.encode())
    for path in sorted((ROOT / "flashlib" / "kernels" / "triton").glob("*.py")):
        h.update(path.name.encode() + path.read_bytes())
    try:
        from importlib.metadata import version
        h.update(version("triton").encode())
    except Exception:                           # pragma: no cover - triton without metadata
        pass
    return h.hexdigest()[:20]


def compile_ttir(root=ROOT, arch: str = ARCH) -> dict[str, str]:
    """{kernel name: TTIR} for every kernel under ``root``'s flashlib, compiled for ``arch`` in a child
    process (TRITON_INTERPRET=0)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    with tempfile.TemporaryDirectory(prefix="flashlib-offsets-") as tmp:
        env["TRITON_CACHE_DIR"] = tmp
        proc = subprocess.run([sys.executable, "-c", _CHILD, arch], capture_output=True, text=True,
                              env=env, cwd=tmp, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OFFSETS-TTIR:")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"compiling the kernels for {arch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("OFFSETS-TTIR:"):])


@pytest.fixture(scope="module")
def ttirs():
    require_tool("ptxas")                       # triton.compile goes on to a cubin
    folder = toolchain.cache_dir("offsets-ttir")
    path = folder / f"{ARCH}-{_source_key()}.json"
    with toolchain.locked(folder / f"{ARCH}.lock"):
        if not path.exists():
            toolchain.build_atomically(path, lambda tmp: tmp.write_text(json.dumps(compile_ttir())))
        for stale in folder.glob(f"{ARCH}-*.json"):
            if stale != path:
                stale.unlink(missing_ok=True)
        return json.loads(path.read_text())


SPECS = {s.name: s for s in triton_specs()}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_stride_product_is_64_bit(ttirs, name):
    spec = SPECS[name]
    products = checked_products(ttirs[name], spec.runtime_args)
    # the checker saw the kernel's offsets: at least the batch and head products of its first tensor
    assert len(products) >= 2, f"{name}: found no multiplication by a stride in its TTIR: parser broken?"
    assert narrow_offsets(name, ttirs[name], spec.runtime_args) == []


# The checker itself, on hand-written TTIR: it must catch a 32-bit product and pass a 64-bit one.
_TTIR = """module {
  tt.func public @k(%X: !tt.ptr<f16> {tt.divisibility = 16 : i32} loc("X"(#loc)), """ \
    """%stride_xb: i32 loc("s"(#loc)), %NQ: i32 loc("NQ"(#loc))) attributes {noinline = false} {
    %b = tt.get_program_id x : i32 loc(#loc1)
    %0 = arith.muli %b, %stride_xb : i32 loc(#loc2)
    %b64 = arith.extsi %b : i32 to i64 loc(#loc3)
    %s64 = arith.extsi %stride_xb : i32 to i64 loc(#loc3)
    %1 = arith.muli %b64, %s64 : i64 loc(#loc3)
    %r = tt.make_range {end = 64 : i32, start = 0 : i32} : tensor<64xi32> loc(#loc4)
    %sp = tt.splat %NQ : i32 -> tensor<64xi32> loc(#loc5)
    %2 = arith.muli %r, %sp : tensor<64xi32> loc(#loc5)
    %r64 = arith.extsi %r : tensor<64xi32> to tensor<64xi64> loc(#loc6)
    %sp64 = tt.splat %s64 : i64 -> tensor<64xi64> loc(#loc6)
    %3 = arith.muli %r64, %sp64 : tensor<64xi64> loc(#loc6)
    %4 = arith.muli %b, %b : i32 loc(#loc7)
    tt.return loc(#loc8)
  } loc(#loc)
} loc(#loc)
"""


def test_checker_flags_32_bit_products_and_passes_64_bit_ones():
    names = ("X", "stride_xb", "NQ")
    found = checked_products(_TTIR, names)
    assert [t for t, _, _ in found] == ["i32", "i64", "tensor<64xi32>", "tensor<64xi64>"]   # not %4
    bad = narrow_offsets("k", _TTIR, names)
    assert [ln.split("=")[0].strip() for ln in bad] == ["%0", "%2"]
    with pytest.raises(ValueError, match="3 arguments"):
        checked_products(_TTIR, names[:2])


# Real data past 2^31 elements, in the interpreter (which wraps i32 products as the GPU does): views of
# one 4.3 GB float16 tensor that is never written as a whole (torch.empty reserves the memory; the OS
# gives pages only to the rows a view touches, a few MB). One view has a batch stride that puts batch 7
# past 2^31 elements, one a row stride that puts row 127 there; decode reads a cache laid out the same
# way. Each result must equal, bit for bit, the same kernel's on compact copies of the same numbers
# (same shapes, same tiles). On the 32-bit kernels the child died of SIGSEGV (a wrapped, negative offset).
_BIG_CHILD = r"""
import json, resource
import torch
import flashlib
from flashlib.kernels.triton import INTERPRET
assert INTERPRET, "this child runs the kernels in Triton's interpreter"
torch.manual_seed(0)
LIMIT = 2 ** 31
big = torch.empty(LIMIT + 2 ** 22, dtype=torch.float16)       # reserved, not touched

def view(shape, strides, offset):
    x = big.as_strided(shape, strides, offset)
    x.copy_(torch.randn(shape, dtype=torch.float16))           # touches only these elements' pages
    return x

def same(a, b):
    return bool(torch.equal(a, b))

out = {}
# batch stride: b * stride_b passes 2^31 at b = 7;  row stride: row * stride_n passes 2^31 at row 127
BS = (LIMIT // 7 // 16 + 1) * 16
RS = (LIMIT // 127 // 16 + 1) * 16
cases = {"batch": ((8, 1, 32, 16), (BS, BS, 16, 1), 512), "rows": ((1, 1, 128, 16), (RS, RS, RS, 1), 16)}
for name, (shape, strides, step) in cases.items():
    assert max((n - 1) * s for n, s in zip(shape, strides)) >= LIMIT
    q, k, v = (view(shape, strides, i * step).requires_grad_() for i in range(3))
    qc, kc, vc = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    do = torch.randn(shape, dtype=torch.float16)
    o = flashlib.attention(q, k, v, causal=True, backend="triton")
    oc = flashlib.attention(qc, kc, vc, causal=True, backend="triton")
    o.backward(do)
    oc.backward(do)
    out[name] = dict(o=same(o, oc), dq=same(q.grad, qc.grad), dk=same(k.grad, kc.grad),
                     dv=same(v.grad, vc.grad), o_finite=bool(torch.isfinite(o).all()))
# decode: a cache (8, 1, 64, 16) whose batch 7 starts past 2^31 elements, V beside K in each batch
kc_ = view((8, 1, 64, 16), (BS, BS, 16, 1), 0)
vc_ = view((8, 1, 64, 16), (BS, BS, 16, 1), 64 * 16)
q = torch.randn(8, 4, 1, 16, dtype=torch.float16)
lens = torch.tensor([64, 1, 17, 0, 33, 64, 5, 64], dtype=torch.int32)
o = flashlib.decode(q, kc_, vc_, cache_seqlens=lens, backend="triton")
oc = flashlib.decode(q, kc_.contiguous(), vc_.contiguous(), cache_seqlens=lens, backend="triton")
out["decode"] = dict(o=same(o, oc), o_finite=bool(torch.isfinite(o).all()))
out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("OFFSETS-BIG:" + json.dumps(out))
"""


def run_big_views(root=ROOT) -> dict:
    """Run :data:`_BIG_CHILD` in a fresh interpreter process against ``root``'s flashlib."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", _BIG_CHILD], capture_output=True, text=True, env=env,
                          cwd=str(root), timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OFFSETS-BIG:")), None)
    if proc.returncode != 0 or line is None:
        raise AssertionError(f"the child died (exit code {proc.returncode}: -11 is SIGSEGV, an offset that "
                             f"wrapped):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("OFFSETS-BIG:"):])


def test_views_past_2_31_elements_read_the_right_rows():
    got = run_big_views()
    for case in ("batch", "rows", "decode"):
        assert all(got[case].values()), (case, got[case])
    assert got["max_rss_mb"] < 1024, got                     # the 4.3 GB tensor stayed untouched
