"""Benchmarks readers run on their GPU: flashlib's Triton kernels against torch SDPA and naive attention.

Forward and backward throughput in TFLOP/s with FlashAttention-2's FLOP count (4·N²·d·H per batch
element forward, 2.5x that backward, halved for causal), and decode bandwidth in GB/s of K/V read,
across sequence lengths N. Timing: ``triton.testing.do_bench`` (CUDA events, warm-up, median).

On a machine with no CUDA GPU nothing is timed: :func:`main` says so and prints the compile report's
summary instead (what the kernels compile to on each GPU) — flashlib never prints a GPU number it did
not measure.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["attention_flops", "decode_bytes", "run", "plot", "main"]

DEFAULT_NS = (512, 1024, 2048, 4096, 8192, 16384)


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, d: int, *, causal: bool = False,
                    backward: bool = False) -> float:
    """FA2's count: ``4 · Nq · Nk · d · H · B`` forward, x2.5 backward, halved when causal.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    flops = 4.0 * n_q * n_k * d * heads * batch
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


def decode_bytes(batch: int, kv_heads: int, n: int, d: int, elem_bytes: int) -> float:
    """Bytes of K and V a decode step reads: ``2 · B · Hkv · N · d · elem``.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_bench.py.
    """
    return 2.0 * batch * kv_heads * n * d * elem_bytes


def _naive(q, k, v, causal):
    """Attention with S and P materialized, in the inputs' dtype (chapter 1, in torch)."""
    import torch
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def _sdpa(q, k, v, causal):
    import torch
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    nq, nk = q.shape[2], k.shape[2]
    if causal and nq != nk:     # SDPA's is_causal is top-left aligned: pass our bottom-right mask
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _time(timer: Callable, fn) -> float | None:
    """Milliseconds per call, or None when the implementation runs out of memory at this size."""
    import torch
    try:
        return float(timer(fn))
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def run(ns=DEFAULT_NS, *, batch=4, heads=16, kv_heads=None, head_dim=128, dtype="float16", causal=False,
        device="cuda", timer: Callable | None = None, progress=True) -> dict:
    """Time forward, backward and decode of "flashlib" (Triton), "sdpa" and "naive" at each N.

    Returns ``{"config": {...}, "rows": [{"n", "impl", "fwd_ms", "bwd_ms", "decode_ms",
    "fwd_tflops", "bwd_tflops", "decode_gbs"}]}`` (None where an implementation ran out of memory).
    ``timer(fn) -> ms`` defaults to ``triton.testing.do_bench``; tests pass another to run the
    plumbing on a CPU at tiny sizes.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/tools/test_bench.py.
    """
    import torch
    from tqdm.auto import tqdm

    import flashlib
    kv_heads = kv_heads or heads
    dt = getattr(torch, dtype)
    if timer is None:
        from triton.testing import do_bench
        timer = do_bench
    backend = "triton"
    rows = []
    for n in tqdm(list(ns), desc="bench N", disable=not progress):
        gen = torch.Generator(device=device).manual_seed(n)
        q = torch.randn(batch, heads, n, head_dim, device=device, dtype=dt, generator=gen)
        k = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dt, generator=gen)
        v = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dt, generator=gen)
        do = torch.randn_like(q)
        q1 = q[:, :, -1:].contiguous()
        impls = {"flashlib": lambda a, b, c: flashlib.attention(a, b, c, causal=causal, backend=backend),
                 "sdpa": lambda a, b, c: _sdpa(a, b, c, causal),
                 "naive": lambda a, b, c: _naive(a, b, c, causal)}
        for name, fn in impls.items():
            row = {"n": n, "impl": name}
            row["fwd_ms"] = _time(timer, lambda: fn(q, k, v))
            row["bwd_ms"] = None
            if row["fwd_ms"] is not None:
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                try:
                    o = fn(qg, kg, vg)
                    row["bwd_ms"] = _time(timer, lambda: torch.autograd.grad(o, (qg, kg, vg), do,
                                                                          retain_graph=True))
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                del qg, kg, vg
            with torch.no_grad():
                if name == "flashlib":
                    dec = lambda: flashlib.decode(q1, k, v, backend=backend)   # noqa: E731
                else:
                    dec = lambda: fn(q1, k, v)                                 # noqa: E731
                row["decode_ms"] = _time(timer, dec)
            fl = attention_flops(batch, heads, n, n, head_dim, causal=causal)
            flb = attention_flops(batch, heads, n, n, head_dim, causal=causal, backward=True)
            by = decode_bytes(batch, kv_heads, n, head_dim, q.element_size())
            row["fwd_tflops"] = fl / (row["fwd_ms"] * 1e-3) / 1e12 if row["fwd_ms"] else None
            row["bwd_tflops"] = flb / (row["bwd_ms"] * 1e-3) / 1e12 if row["bwd_ms"] else None
            row["decode_gbs"] = by / (row["decode_ms"] * 1e-3) / 1e9 if row["decode_ms"] else None
            rows.append(row)
    device_name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    return {"config": dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                           causal=causal, device=device_name), "rows": rows}


def plot(results: dict, path=None):
    """Three panels (forward TFLOP/s, backward TFLOP/s, decode GB/s) against N; saved if ``path``.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/tools/test_bench.py.
    """
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("fwd_tflops", "forward TFLOP/s"), ("bwd_tflops", "backward TFLOP/s"),
              ("decode_gbs", "decode GB/s (K/V read)"))
    for ax, (key, label) in zip(axes, panels):
        for impl in dict.fromkeys(r["impl"] for r in results["rows"]):
            pts = [(r["n"], r[key]) for r in results["rows"] if r["impl"] == impl and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    c = results["config"]
    fig.suptitle(f"measured on {c['device']}: B={c['batch']} H={c['heads']} Hkv={c['kv_heads']} "
                 f"d={c['head_dim']} {c['dtype']}{' causal' if c['causal'] else ''}")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def format_results(results: dict) -> str:
    """The measurements as a table (None: out of memory)."""
    def f(x):
        return "OOM" if x is None else f"{x:8.1f}"
    lines = [f"{'N':>6} {'impl':<9} {'fwd TF/s':>8} {'bwd TF/s':>8} {'dec GB/s':>8}"]
    for r in results["rows"]:
        lines.append(f"{r['n']:>6} {r['impl']:<9} {f(r['fwd_tflops'])} {f(r['bwd_tflops'])} "
                     f"{f(r['decode_gbs'])}")
    return "\n".join(lines)


def main(args) -> int:
    """``python -m flashlib bench``: measure on the GPU, or say there is none and show the compile report.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/tools/test_selfcheck.py.
    """
    import torch
    if not torch.cuda.is_available():
        print("No CUDA GPU on this machine: nothing to time (flashlib never prints a GPU number it did "
              "not measure). Run this in Colab or on a GPU machine.\n"
              "What the kernels compile to on each GPU instead (flashlib.tools.compile_report.compile_report):")
        from .compile_report import compile_report, summary
        print(summary(compile_report()))
        return 0
    results = run(args.n, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype, causal=args.causal)
    print(format_results(results))
    if args.out:
        plot(results, args.out)
        print(f"plot saved to {args.out}")
    return 0


def add_arguments(parser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument("--n", type=int, nargs="+", default=list(DEFAULT_NS), help="sequence lengths")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer kv heads (default: heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", default="flashlib-bench.png", help="plot file ('' for none)")

