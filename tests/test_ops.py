"""flashlib._ops, all of flashlib.attention's autograd and flashlib.decode's op: the torch.library custom
ops pass torch's opcheck, call the chosen backend's forward, backward and decode, and compile with no
graph break.

On conftest's DEVICE: the op runs the compiled Triton kernels on a GPU machine, the reference on a CPU.
"""
import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashlib
from api_cases import make_qkv, run_python
from conftest import DEVICE
from flashlib.backends import BACKENDS, Backend, registered


class Block(torch.nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.qkv, self.h = torch.nn.Linear(d, 3 * d), h

    def forward(self, x):                                        # (B, N, C)
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        return flashlib.attention(q, k, v, causal=True).transpose(1, 2).reshape(b, n, c)


def _ops_called(graph_module) -> list:
    """The targets of a traced graph's calls into flashlib's custom ops."""
    return [str(n.target) for n in graph_module.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("flashlib.")]


def test_dynamo_explain_finds_no_graph_break():
    m, x = Block().to(DEVICE), torch.randn(2, 7, 16, device=DEVICE)
    explain = torch._dynamo.explain(m)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    assert _ops_called(explain.graphs[0]) == ["flashlib.attention_fwd.default"]


def test_compiled_module_matches_eager_forward_and_backward():
    torch._dynamo.reset()
    m, x = Block().to(DEVICE), torch.randn(2, 7, 16, device=DEVICE, requires_grad=True)
    eager = m(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    (g_comp,) = torch.autograd.grad(compiled.sum(), x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(g_comp, g_eager)


def test_the_op_calls_the_backends_forward_and_backward_by_its_name():
    """The backend travels through the op as its registry name; the backward runs the same backend,
    and what it returns is made contiguous (the op's promise to torch.compile)."""
    ref, calls = BACKENDS["reference"], []

    def forward(*args, **kwargs):
        calls.append("forward")
        o, lse = ref.forward(*args, **kwargs)
        return o.transpose(-1, -2).contiguous().transpose(-1, -2), lse       # not contiguous

    def backward(*args, **kwargs):
        calls.append(("backward", kwargs["blocks"]))
        return ref.backward(*args, **kwargs)

    q, k, v = make_qkv(H=2, HKV=1, NQ=5, NK=7, D=8, dtype=torch.float32, grad=True)
    with registered(Backend("traced", forward, backward, ref.decode, ref.check)):
        o = flashlib.attention(q, k, v, causal=True, backend="traced", block_q=4)
        assert o.is_contiguous()
        o.sum().backward()
    assert calls == ["forward", ("backward", (4, None))]      # block_k=None travels as 0, comes back None
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    flashlib.attention(q2, k2, v2, causal=True, backend="reference", block_q=4).sum().backward()
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert torch.equal(a, b)


def test_custom_op_passes_torch_opcheck():
    q, k, v = make_qkv(dtype=torch.float32, grad=True)
    flashlib.attention(q, k, v, backend="reference")             # registers the ops on first use
    torch.library.opcheck(torch.ops.flashlib.attention_fwd.default,
                          (q, k, v, True, 0.25, False, "reference", None, None, None, None))
    torch.library.opcheck(torch.ops.flashlib.attention_fwd.default,
                          (q, k, v, False, 0.25, False, "reference", 5, 3, None, None))   # user blocks


def test_attention_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) fails on any graph break: the custom op keeps attention whole."""
    q, k, v = make_qkv(NQ=9, NK=12, D=16, dtype=torch.float32, grad=True)

    def loss(q, k, v):
        return flashlib.attention(q, k, v, causal=True, backend="reference").square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    out.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    expected = loss(q, k, v)
    expected.backward()
    assert torch.allclose(out, expected, atol=1e-5)
    assert all(torch.allclose(a, x.grad, atol=1e-5) for a, x in zip(grads, (q, k, v)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only situation")
def test_reference_first_then_triton_on_cpu_in_one_process():
    """Calling a torch custom op imports triton; flashlib must have chosen Triton's mode before that."""
    r = run_python("""
        import torch, flashlib
        q = torch.randn(1, 2, 5, 16)
        a = flashlib.attention(q, q, q, backend="reference")
        b = flashlib.attention(q, q, q, backend="triton")
        print("SAME", bool(torch.allclose(a, b, atol=1e-5)))
        """)
    assert r.returncode == 0, r.stderr
    assert "SAME True" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only situation")
def test_torch_compile_before_the_first_triton_call_on_cpu():
    """torch.compile imports triton (torch._dynamo does) before flashlib's first Triton call:
    flashlib's import hook (flashlib._TritonModeFirst) has that first import interpret on a machine without a
    GPU, so the compiled call runs in Triton's interpreter (it raised dynamo's "Observed exception"
    around "triton was imported in compile mode" before). The hook itself imports nothing."""
    r = run_python("""
        import importlib.util, os, sys
        import flashlib
        importlib.util.find_spec("triton")            # a probe without torch: decides nothing
        print("NO_TORCH", "torch" not in sys.modules, "TRITON_INTERPRET" not in os.environ)
        import torch
        step = torch.compile(lambda q, k, v: flashlib.attention(q, k, v, causal=True,
                                                                backend="triton"),
                             fullgraph=True, backend="aot_eager")
        print("TRITON_FIRST", "triton" in sys.modules, "flashlib.kernels.triton" not in sys.modules)
        q, k, v = torch.randn(3, 1, 2, 5, 16).unbind(0)
        want = flashlib.attention(q, k, v, causal=True, backend="reference")
        print("SAME", bool(torch.allclose(step(q, k, v), want, atol=1e-5)))
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NO_TORCH True True" in r.stdout
    assert "TRITON_FIRST True True" in r.stdout             # the order this test is about
    assert "SAME True" in r.stdout


class _Sub(torch.Tensor):
    """A tensor subclass that changes nothing: only its type differs from torch.Tensor."""


def test_path_is_the_op_only_where_compile_modes_subclasses_or_transforms_need_it():
    """_ops.path: "backend" for eager inference, "function" when only autograd needs a backward, "op"
    under a dispatch mode (FakeTensorMode, FlopCounterMode), for a tensor subclass and inside a
    torch.func transform (torch.compile: see the next test)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from flashlib import _ops
    q, k, v = make_qkv(H=2, HKV=1, NQ=5, NK=7, D=8, dtype=torch.float32)
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        assert _ops.path(qg, k, v) == "backend"
    assert _ops.path(q, k, v) == "backend"                         # grad enabled, nothing requires it
    assert _ops.path(q, k, v, None) == "backend"                   # decode's cache_seqlens=None
    assert _ops.path(qg, k, v) == _ops.path(q, k, v.clone().requires_grad_()) == "function"
    with FlopCounterMode(display=False):
        assert _ops.path(q, k, v) == _ops.path(qg, k, v) == "op"
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        assert _ops.path(fq, fk, fv) == "op"
        o = flashlib.attention(fq, fk, fv, backend="reference")   # the op's fake: shapes, no kernel
        assert o.shape == q.shape
    assert _ops.path(q.as_subclass(_Sub), k, v) == _ops.path(q, k, v, k.as_subclass(_Sub)) == "op"
    seen = []
    torch.func.grad(lambda x: seen.append(_ops.path(x, k, v)) or x.sum())(q)
    assert seen == ["op"]


@pytest.fixture
def ways(monkeypatch):
    """Which way each flashlib.attention call went: "op", "function" or "backend" (a spy on each)."""
    from flashlib import _ops
    taken = []

    def spy(name, fn):
        return lambda *args: taken.append(name) or fn(*args)
    monkeypatch.setattr(_ops, "attention_op", spy("op", _ops.attention_op))
    monkeypatch.setattr(_ops.Attention, "apply", spy("function", _ops.Attention.apply))
    for name, real in list(BACKENDS.items()):
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(
            real, forward=lambda *a, _real=real, **kw: taken.append("backend") or _real.forward(*a, **kw)))
    return taken


def test_each_call_takes_the_way_path_documents(ways):
    """The spies see one way per call, and the compiled graph holds the op (one of it, no break)."""
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v = make_qkv(H=2, HKV=1, NQ=5, NK=7, D=8, dtype=torch.float32)
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        flashlib.attention(qg, k, v, backend="reference")
    flashlib.attention(qg, k, v, backend="reference")
    with FlopCounterMode(display=False):
        flashlib.attention(qg, k, v, backend="reference")
    # the function and the op call the backend themselves: "backend" follows them
    assert ways == ["backend", "function", "backend", "op", "backend"]
    torch._dynamo.reset()
    explain = torch._dynamo.explain(lambda q, k, v: flashlib.attention(q, k, v, backend="reference"))(qg, k, v)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    assert _ops_called(explain.graphs[0]) == ["flashlib.attention_fwd.default"]


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing, so that calls inside it take the op (path = "op")."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_function_and_the_op_give_bit_identical_gradients(backend, dtype, ways):
    """Causal, GQA, Nq > Nk: the first Nq - Nk = 3 query rows see no key (o = 0, gradients 0, no NaN)."""
    q, k, v = make_qkv(B=1, H=4, HKV=2, NQ=9, NK=6, D=16, dtype=dtype, seed=7, device=DEVICE)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(q)
    results = []
    for context in (contextlib.nullcontext, _PassThrough):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with context():
            o = flashlib.attention(*leaves, causal=True, backend=backend)
            results.append((o, *torch.autograd.grad(o, leaves, do)))
    assert ways == ["function", "backend", "op", "backend"]
    for by_function, by_op in zip(*results):
        assert torch.equal(by_function, by_op) and not by_function.isnan().any()
    assert (results[0][0][:, :, :3] == 0).all() and (results[0][1][:, :, :3] == 0).all()    # o, dq


@pytest.mark.parametrize("way", ["function", "op"])
def test_a_second_backward_is_a_clear_error_not_a_silently_missing_term(way):
    """A gradient penalty differentiates dq again. The kernels' gradients are constants to autograd, so
    on either way that must fail, naming the op, rather than return a gradient without the attention
    term; a backward with create_graph=True that is not differentiated again still works."""
    q, k, v = make_qkv(B=1, H=2, HKV=1, NQ=7, NK=5, D=8, dtype=torch.float32, seed=3, device=DEVICE)
    w = torch.ones((), requires_grad=True)
    context = _PassThrough if way == "op" else contextlib.nullcontext
    with context():
        qg = q.clone().requires_grad_()
        o = flashlib.attention(qg * w, k, v, causal=True, backend="reference")
        (dq,) = torch.autograd.grad(o.sum(), qg, create_graph=True)
        assert torch.equal(dq, torch.autograd.grad(flashlib.attention(qg * w, k, v, causal=True,
                                                                      backend="reference").sum(), qg)[0])
        with pytest.raises(RuntimeError, match="attention_bwd"):
            torch.autograd.grad((dq ** 2).sum() + (w ** 2).sum(), w)


# ------------------------------------------------------------------- decode: one op for torch.compile

@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_compiles_to_one_op_without_graph_break_and_matches_eager(backend):
    """Before flashlib::decode, dynamo traced into the backend (NumPy for "reference") and failed:
    "RuntimeError when making fake tensor call", or with fullgraph "Unsupported ndarray attribute"."""
    q, kc, vc = make_qkv(B=2, H=4, HKV=2, NQ=1, NK=40, D=16, dtype=torch.float32, seed=4, device=DEVICE)

    def step(q, kc, vc):
        return flashlib.decode(q, kc, vc, num_splits=2, backend=backend) * 2

    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(q, kc, vc)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    assert _ops_called(explain.graphs[0]) == ["flashlib.decode.default"]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc)
    torch.testing.assert_close(compiled, step(q, kc, vc), rtol=0, atol=0)


def test_decode_with_lengths_compiles_and_matches_eager():
    """Explicit lengths: never read by the host while torch.compile traces (on a GPU never at all; in
    eager CPU lengths are range-checked), so even CPU lengths compile to one graph with fullgraph."""
    q, kc, vc = make_qkv(B=3, H=4, HKV=1, NQ=2, NK=30, D=8, dtype=torch.float32, seed=5, device=DEVICE)
    lens = torch.tensor([30, 0, 11], device=DEVICE)

    def step(q, kc, vc, lens):
        return flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=3, return_lse=True)

    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(q, kc, vc, lens)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    (o, lse), (o_eager, lse_eager) = (torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, lens),
                                      step(q, kc, vc, lens))
    torch.testing.assert_close(o, o_eager, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_eager, rtol=0, atol=0)
    assert torch.isneginf(lse[1]).all() and (o[1] == 0).all()


@pytest.mark.parametrize("backend,dtype,strided,lens", [
    ("reference", torch.float32, False, "int64"),
    ("reference", torch.float64, True, "int32"),
    ("triton", torch.float32, True, "int32"),
    ("triton", torch.float16, False, "int64"),
])
def test_decode_op_passes_opcheck_and_its_fake_is_the_real_op(backend, dtype, strided, lens):
    """torch.library.opcheck (schema, fake tensor, AOT dispatch), and the fake's shapes, dtypes and
    strides are the real op's, also for a query strided as a Hugging Face model's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, kc, vc = make_qkv(B=2, H=4, HKV=2, NQ=3, NK=20, D=16, dtype=dtype, seed=6, device=DEVICE)
    if strided:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)      # (B, H, Nq, d) viewed from (B, Nq, H, d)
    seqlens = torch.tensor([20, 7], dtype=getattr(torch, lens), device=DEVICE)
    args = (q, kc, vc, seqlens, 2, 0.25, backend, None)
    flashlib.decode(q, kc, vc, backend=backend)                  # registers the ops on first use
    torch.library.opcheck(torch.ops.flashlib.decode.default, args)
    real = torch.ops.flashlib.decode.default(*args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.flashlib.decode.default(*args)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride(), r.device) == (f.shape, f.dtype, f.stride(), f.device)
