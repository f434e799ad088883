"""``python -m flashlib info`` and ``python -m flashlib check``: what is here, and does it work here.

``info`` lists versions, the device, and each backend with whether it runs on this device: a backend is
called available only after a small forward through it has run here (a static claim would have said
"available" for a CUDA backend that could not compile on a real GPU). ``check`` runs every backend
that can run against the float64 oracle at a few awkward shapes on the present device (a CUDA GPU if
there is one, else the CPU) — forward, backward and decode — plus, on a GPU, a backward at a realistic
size (N ~ 1000, d = 128: large enough to use the real kernel configs) run twice and compared bit for
bit: the class of bug a real H100 found in a kernel that passed every CPU test. It prints a table: the
first thing a Colab reader runs. ``check`` never crashes: every row ends as pass, FAIL (a wrong
result), error (an exception, with its reason) or skipped (the backend cannot run on this device, and
why); the exit status is 0 only if every row that ran passed, and at least one ran (a check where every
backend was skipped proved nothing, and says so).

Explained in: notebooks/11_models.
"""
from __future__ import annotations

import importlib.metadata
import platform
import time

from .toolchain import find_tool

__all__ = ["info", "check", "CHECK_CASES", "DETERMINISM_CASE"]   # and the command line's printers

# (B, H, Hkv, Nq, Nk, d, causal): odd lengths, Nq != Nk both ways, fully-masked rows, GQA, MQA
CHECK_CASES = [
    (1, 2, 2, 37, 37, 64, True),
    (2, 4, 2, 19, 45, 40, False),
    (1, 2, 1, 45, 19, 59, True),          # causal with Nq > Nk: rows that see nothing
    (1, 1, 1, 1, 130, 128, False),
]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device():
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _try_backend(name: str, dev) -> tuple[bool, str]:
    """Run a tiny forward through backend ``name`` on ``dev``: ``(True, description)`` if it ran and
    gave finite values, else ``(False, why)``."""
    import torch

    from .. import api
    from ..backends import BACKENDS
    backend = BACKENDS[name]
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 2, 5, 16, device=dev).to(dtype) for _ in range(3))
    try:
        backend.check(q, "attention")
        o = api.attention(q, k, v, causal=True, backend=name)
        if not bool(torch.isfinite(o).all()):
            return False, f"a {tuple(q.shape)} {str(dtype)[6:]} forward ran but gave non-finite values"
    except Exception as e:                         # noqa: BLE001 - the reason is what we report
        return False, f"{type(e).__name__}: {e}"
    ran = f"a {str(dtype)[6:]} forward ran here"
    if name == "cuda":
        ran += "; " + _cuda_versions(dev)
    return True, f"{backend.description} ({ran})"


def _cuda_versions(dev) -> str:
    """Which CUDA kernels backend "cuda" runs on ``dev``, per dtype: forward version and backward."""
    import torch

    from ..kernels import cuda
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    parts = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype)[6:]
        try:
            fwd = cuda.pick_version(name, capability=cap)
        except TypeError:
            parts.append(f"{name}: not on this GPU")
            continue
        probe = torch.empty(1, 1, 1, 64, dtype=dtype, device=dev)
        bwd = "CUDA backward" if cuda.backward_supported(probe) is None else "backward from another backend"
        parts.append(f"{name}: forward {fwd}, {bwd}")
    return "kernels here — " + "; ".join(parts) + " (CUDA backward: d <= 128)"


def info() -> dict:
    """Versions, the device, compilers, and per backend ``(available, reason)`` on this device; a
    backend is available only after a small forward through it ran here.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_selfcheck.py.
    """
    import torch

    from .. import __version__
    from ..backends import BACKENDS
    dev = _device()
    out = {
        "flashlib": __version__, "python": platform.python_version(), "numpy": _version("numpy"),
        "torch": torch.__version__, "triton": _version("triton"),
        "device": "cpu (no CUDA GPU: Triton runs in its interpreter)" if dev.type == "cpu" else
        f"{torch.cuda.get_device_name(0)} (sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}, "
        f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
        "nvcc": find_tool("nvcc") or "not found", "g++": find_tool("g++") or "not found",
        "triton forward": _triton_version("FLASHLIB_TRITON_FWD"),
        "triton backward": _triton_version("FLASHLIB_TRITON_BWD"),
        "backends": {name: _try_backend(name, dev) for name in sorted(BACKENDS)},
    }
    return out


def _triton_version(variable: str) -> str:
    """Which Triton kernel ``backend="triton"`` runs, as the environment variable ``variable`` sets its
    default (FLASHLIB_TRITON_FWD or FLASHLIB_TRITON_BWD; flashlib.backends.triton's tables)."""
    import os

    from ..backends.triton import BACKWARD, FORWARD
    family = FORWARD if variable == FORWARD.env else BACKWARD
    default, other = family.variants
    wanted = os.environ.get(variable)
    if wanted is None:
        return f"{default.name} (default; {variable}={other.name} runs {other.name} where it applies)"
    try:
        chosen = family.get(wanted, source=variable)
    except ValueError as exc:
        return f"{exc}: backend='triton' will refuse"
    if chosen is default:
        return f"{default.name} ({variable})"
    return f"{chosen.name} ({variable}) wherever fa2_fwd_v4_tma.supported agrees, else {default.name}"


def format_info(d: dict) -> str:
    width = max(len(k) for k in d)
    lines = [f"{k:>{width}}: {v}" for k, v in d.items() if k != "backends"]
    lines.append(f"{'backends':>{width}}:")
    for name, (ok, why) in d["backends"].items():
        lines.append(f"   {name:<10} {'available' if ok else 'NOT available'} — {why}")
    return "\n".join(lines)


def _dtypes(dev):
    import torch
    if dev.type == "cpu":
        return [torch.float32, torch.float16]
    cc = torch.cuda.get_device_capability(dev)
    return [torch.float32, torch.float16] + ([torch.bfloat16] if cc >= (8, 0) else [])


def _inputs(case, dtype, dev, seed):
    """q, k, v, do of ``case`` (B, H, Hkv, Nq, Nk, d, causal) on ``dev``, drawn on the CPU from ``seed``."""
    import torch
    b, h, hkv, nq, nk, d, _ = case
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dev, dtype)
            for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, h, nq, d))]


def _one(backend, case, dtype, dev) -> str:
    """Forward + backward of one case against the oracle (:func:`flashlib.testing.assert_attention_right`);
    returns the row's note."""
    import torch

    from .. import api
    from ..testing import assert_attention_right
    q, k, v, do = _inputs(case, dtype, dev, seed=case[3] * 131 + case[4])
    causal = case[-1]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, lse = api.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    grads = torch.autograd.grad(o, (q, k, v), do)
    return assert_attention_right(q, k, v, do, causal=causal, o=o, lse=lse, grads=grads)


def _decode_one(backend, dtype, dev) -> str:
    """A ragged decode (lengths 77, 5 and 0) against the oracle, sequence by sequence."""
    import numpy as np
    import torch

    from .. import api
    from ..testing import assert_close, assert_fa_rule, plain_torch_attention, reference_gqa
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 1, 64, generator=g).to(dev, dtype)
    kc, vc = (torch.randn(3, 2, 77, 64, generator=g).to(dev, dtype) for _ in range(2))
    lens = torch.tensor([77, 5, 0], device=dev, dtype=torch.int32)
    o, lse = api.decode(q, kc, vc, cache_seqlens=lens, return_lse=True, backend=backend)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            assert_close(o[b].cpu().double(), np.zeros(o[b].shape), atol=0, rtol=0, name="empty o")
            assert bool(torch.isneginf(lse[b]).all()), "lse of an empty cache must be -inf"
            continue
        o_ref, _ = reference_gqa(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n])
        if dtype == torch.float32:
            assert_close(o[b:b + 1].cpu().double(), o_ref, atol=2e-5, rtol=2e-5, name="decode o")
        else:
            base = plain_torch_attention(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n])
            assert_fa_rule(o[b:b + 1], base, o_ref, name="decode o")
    return "ragged cache (77, 5, 0) matches the oracle"


# The variants case: a sliding window, softcap, per-batch ALiBi, sinks and dropout at once, causal with
# Nq < Nk and GQA, a head dim no power of two (run only by backends that compute the variants).
VARIANTS_CASE = (2, 4, 2, 19, 27, 40, True)


def _variants_one(backend, dtype, dev, case=VARIANTS_CASE) -> str:
    """Forward and backward (dsinks included) with every variant against the oracle, dropout's mask
    from :func:`flashlib.dropout_mask` (the same Philox bits every backend draws)."""
    import torch

    from .. import api
    from ..testing import assert_attention_right
    q, k, v, do = _inputs(case, dtype, dev, seed=99)
    b, h = case[0], case[1]
    g = torch.Generator().manual_seed(5)
    slopes = torch.rand(b, h, generator=g).to(dev)
    sinks = torch.randn(h, generator=g).to(dev).requires_grad_()
    kw = dict(window_size=(6, 0), softcap=4.0, alibi_slopes=slopes, dropout_p=0.2, dropout_seed=(77, 3))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o, lse = api.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend=backend, **kw)
    grads = torch.autograd.grad(o, (q, k, v, sinks), do)
    z = api.dropout_mask(q, k, 0.2, (77, 3)).cpu().numpy()
    return assert_attention_right(q, k, v, do, causal=True, o=o, lse=lse, grads=grads, window_size=(6, 0),
                                  softcap=4.0, alibi_slopes=slopes.cpu().double().numpy(),
                                  sinks=sinks.detach().cpu().double().numpy(), dropout_p=0.2, dropout_mask=z)


# The serving case (chapter 10): a ragged batch with an empty sequence, a sequence of queries and no key,
# length 1 and lengths no block divides, GQA, causal; and a paged decode appending 3 causal tokens.
SERVING_LENGTHS = ((13, 20), (0, 5), (7, 0), (1, 1), (40, 33))


def _serving_one(backend, dtype, dev) -> str:
    """attention_varlen forward and backward against the oracle (FlashAttention's 2x/3x rule against
    plain torch per sequence), then decode with appended causal tokens on a paged cache (page size 3,
    shuffled pages) bit-for-bit equal to the same decode on a dense cache."""
    import numpy as np
    import torch

    from .. import api
    from ..testing import assert_fa_rule, plain_torch_attention, reference_varlen
    g = torch.Generator().manual_seed(11)
    nq, nk = (list(x) for x in zip(*SERVING_LENGTHS))
    cu_q, cu_k = (torch.tensor(np.cumsum([0] + n), dtype=torch.int32, device=dev) for n in (nq, nk))
    q, do = (torch.randn(sum(nq), 4, 40, generator=g).to(dev, dtype) for _ in range(2))
    k, v = (torch.randn(sum(nk), 2, 40, generator=g).to(dev, dtype).requires_grad_() for _ in range(2))
    q.requires_grad_()
    o = api.attention_varlen(q, k, v, cu_q, cu_k, max(nq), max(nk), causal=True, backend=backend)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref, _, g_ref = reference_varlen(q.detach(), k.detach(), v.detach(), cu_q.cpu(), cu_k.cpu(), causal=True,
                                       do=do.cpu())
    base = [torch.zeros_like(x) for x in (q, q, k, v)]           # plain torch per sequence: o, dq, dk, dv
    for b in range(len(nq)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if nq[b] and nk[b]:
            xs = [x.detach()[r].transpose(0, 1)[None].requires_grad_() for x, r in ((q, rq), (k, rk), (v, rk))]
            kb, vb = (x.repeat_interleave(2, 1) for x in xs[1:])                 # GQA: 2 heads per kv
            ob = plain_torch_attention(xs[0], kb, vb, causal=True)
            gb = torch.autograd.grad(ob, xs, do[rq].transpose(0, 1)[None])
            base[0][rq] = ob.detach()[0].transpose(0, 1)
            for out, gr, r in zip(base[1:], gb, (rq, rk, rk)):
                out[r] = gr[0].transpose(0, 1)
    assert_fa_rule(o, base[0], o_ref, name="varlen o")
    for name, got, b_, want in zip(("dq", "dk", "dv"), grads, (base[1], base[2], base[3]), g_ref):
        assert_fa_rule(got, b_, want, factor=3.0, name=f"varlen {name}")
    return _paged_equals_dense(backend, dtype, dev) + "; varlen fwd+bwd match the oracle"


def _paged_equals_dense(backend, dtype, dev) -> str:
    """Decode appending 3 causal tokens: a paged cache (page size 3, pages shuffled) gives the dense
    cache's answer bit for bit, and both caches hold the appended tokens."""
    import torch

    from .. import api
    g = torch.Generator().manual_seed(12)
    B, HKV, NMAX, D, PS = 3, 2, 48, 64, 3
    dense = [torch.randn(B, HKV, NMAX, D, generator=g).to(dev, dtype) for _ in range(2)]
    per = NMAX // PS
    table = torch.randperm(B * per, generator=g).reshape(B, per).to(dev, torch.int32)
    paged = [torch.empty(B * per, PS, HKV, D, device=dev, dtype=dtype) for _ in range(2)]
    for d_, p_ in zip(dense, paged):
        p_[table.long()] = d_.transpose(1, 2).reshape(B, per, PS, HKV, D)
    q = torch.randn(B, 4, 3, D, generator=g).to(dev, dtype)
    new = [torch.randn(B, HKV, 3, D, generator=g).to(dev, dtype) for _ in range(2)]
    lens = torch.tensor([0, 17, 45], dtype=torch.int32, device=dev)
    a = api.decode(q, *dense, k=new[0], v=new[1], cache_seqlens=lens, causal=True, num_splits=2,
                   return_lse=True, backend=backend)
    b = api.decode(q, *paged, k=new[0].transpose(1, 2), v=new[1].transpose(1, 2), cache_seqlens=lens,
                   block_table=table, causal=True, num_splits=2, return_lse=True, backend=backend)
    for name, x, y in zip(("o", "lse"), a, b):
        if not torch.equal(x, y):
            raise AssertionError(f"paged decode's {name} differs from dense decode's (max "
                                 f"{(x.double() - y.double()).abs().max().item():.2e})")
    return "paged decode (page 3, append 3 causal) == dense bit for bit"


# The realistic backward: N ~ 1000 and d = 128 reach the kernels' real GPU configs (a test of 40 tokens
# never does); GQA and causal with Nq != Nk, so every masking path runs.
DETERMINISM_CASE = (2, 8, 2, 1000, 1037, 128, True)


def _determinism_one(backend, dtype, dev, case=DETERMINISM_CASE) -> str:
    """The backward of ``case`` twice on the same inputs: bit-for-bit equal, and right (the oracle)."""
    import torch

    from .. import api
    from ..testing import assert_attention_right
    q, k, v, do = _inputs(case, dtype, dev, seed=1234)
    causal = case[-1]
    runs = []
    for _ in range(2):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = api.attention(*leaves, causal=causal, backend=backend)
        runs.append(torch.autograd.grad(o, leaves, do))
    for n, a, b2 in zip(("dq", "dk", "dv"), *runs):
        if not torch.equal(a, b2):
            raise AssertionError(f"{n} differs between two identical backward calls (max "
                                 f"{(a.double() - b2.double()).abs().max().item():.2e}): not deterministic")
    assert_attention_right(q, k, v, do, causal=causal, grads=runs[0])
    return "two backward calls bit-for-bit equal, and right (oracle)"


def _cases(dev, backend: str = "triton"):
    """The check's cases on ``dev``: the awkward shapes, the ragged decode, and on a GPU the realistic
    backward twice for the backends whose backward runs GPU kernels (on a CPU the interpreter runs one
    program at a time, and "reference" is NumPy on the CPU wherever its tensors live: nothing races)."""
    from ..backends import BACKENDS
    from ..validation import VARIANT_NAMES
    races = dev.type == "cuda" and backend != "reference"
    variants = not BACKENDS[backend].lacks("attention", VARIANT_NAMES)
    serving = not BACKENDS[backend].lacks("varlen", ()) and not BACKENDS[backend].lacks("decode", ("block_table",))
    return [*CHECK_CASES, "decode", *(["variants"] if variants else []), *(["serving"] if serving else []),
            *(["determinism"] if races else [])]


def _run_case(name, case, dtype, dev) -> tuple[str, str]:
    """One row's ``(status, note)``: pass, FAIL (an AssertionError: a wrong result) or error (any other
    exception, with its reason). Never raises."""
    try:
        if case == "decode":
            note = _decode_one(name, dtype, dev)
        elif case == "determinism":
            note = _determinism_one(name, dtype, dev)
        elif case == "variants":
            note = _variants_one(name, dtype, dev)
        elif case == "serving":
            note = _serving_one(name, dtype, dev)
        else:
            note = _one(name, case, dtype, dev)
        return "pass", note
    except AssertionError as e:
        return "FAIL", str(e)
    except Exception as e:                         # noqa: BLE001 - check never crashes; it reports
        return "error", f"{type(e).__name__}: {e}"


def check(backends=None, on_row=None) -> list[dict]:
    """Run each backend that can run here against the oracle; one row per (backend, dtype, case).

    Each row's status is pass, FAIL, error (with the exception) or skipped (the backend cannot run on
    this device, with why). :func:`exit_code` turns the rows into the command's exit status.
    ``on_row(row)``, if given, sees each row as soon as it is done (the command line prints it).

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/tools/test_selfcheck.py.
    """
    import torch

    from ..backends import BACKENDS
    dev = _device()
    if isinstance(backends, str) or not (backends is None or hasattr(backends, "__iter__")):
        hint = f" (a list of names: [{backends!r}])" if isinstance(backends, str) else ""
        raise TypeError(f"backends must be a list of backend names or None, got "
                        f"{type(backends).__name__} {backends!r}{hint}")
    if on_row is not None and not callable(on_row):
        raise TypeError(f"on_row must be a function of one row or None, got {type(on_row).__name__}")
    names = sorted(BACKENDS) if backends is None else list(backends)
    for name in names:
        if not isinstance(name, str) or name not in BACKENDS:
            raise ValueError(f"backends must name registered backends {sorted(BACKENDS)}, got {name!r}")
    rows = []
    for name in names:
        for dtype in _dtypes(dev):
            probe = torch.zeros(1, 1, 1, 16, device=dev, dtype=dtype)
            try:
                BACKENDS[name].check(probe, "attention")
            except Exception as e:                 # noqa: BLE001 - reported as "skipped: why"
                rows.append({"backend": name, "dtype": str(dtype)[6:], "case": "-", "status": "skipped",
                             "note": f"{type(e).__name__}: {e}", "seconds": 0.0})
                if on_row:
                    on_row(rows[-1])
                continue
            for case in _cases(dev, name):
                t0 = time.perf_counter()
                status, note = _run_case(name, case, dtype, dev)
                rows.append({"backend": name, "dtype": str(dtype)[6:], "case": _case_name(case),
                             "status": status, "note": note,
                             "seconds": round(time.perf_counter() - t0, 2)})
                if on_row:
                    on_row(rows[-1])
    return rows


NOTHING_RAN = ("nothing ran: every backend was skipped on this device (the notes say why), so nothing was "
               "checked; exit status 1")


def exit_code(rows) -> int:
    """0 if every row that ran passed and at least one ran (skipped rows did not run), else 1: an
    all-skipped check proved nothing, and must not read as a pass to a script or ``make test-gpu``.

    Tested in: tests/tools/test_selfcheck.py.
    """
    ran = [r for r in rows if r["status"] != "skipped"]
    return 0 if ran and all(r["status"] == "pass" for r in ran) else 1


def _case_name(case) -> str:
    if case == "decode":
        return "decode B3 H4/2 Nq1 Nmax77 d64 ragged"
    if case == "determinism":
        return "bwd x2 bitwise " + _case_name(DETERMINISM_CASE)
    if case == "variants":
        return "variants " + _case_name(VARIANTS_CASE)
    if case == "serving":
        return "serving: varlen fwd+bwd, paged decode + append"
    b, h, hkv, nq, nk, d, causal = case
    return f"B{b} H{h}/{hkv} Nq{nq} Nk{nk} d{d}{' causal' if causal else ''}"


CHECK_HEAD = f"{'backend':<10} {'dtype':<9} {'case':<52} {'status':<7} {'s':>6}  note"


def format_row(r) -> str:
    """One row of the check's table."""
    return (f"{r['backend']:<10} {r['dtype']:<9} {r['case']:<52} {r['status']:<7} {r['seconds']:>6.2f}  "
            f"{r['note'][:120]}")


def format_check(rows, *, head: bool = True) -> str:
    """The table (``head=False``: only the totals line, for rows already printed one by one)."""
    lines = [CHECK_HEAD, "-" * len(CHECK_HEAD), *map(format_row, rows)] if head else []
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "FAIL", "error", "skipped")}
    lines.append(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['error']} errors, "
                 f"{counts['skipped']} skipped (cannot run on this device)")
    if counts["skipped"] == len(rows):
        lines.append(NOTHING_RAN)
    return "\n".join(lines)
