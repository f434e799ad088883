"""The Triton puzzles of chapter 7: the checker launches the reader's kernel (interpreter on a CPU,
compiled on a GPU); the reference kernels pass, plausible wrong kernels fail saying why, a stub kernel is
"not attempted", and what is not a @triton.jit kernel is refused."""
from __future__ import annotations

import pytest
from conftest import need_module

need_module("triton")   # conftest imported flashlib.kernels.triton first: the interpreter on a CPU
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashlib import puzzles  # noqa: E402
from flashlib.puzzles import check, triton_solutions  # noqa: E402

TRITON_PUZZLES = [p for p in puzzles.PUZZLES.values() if p.chapter == "notebooks/07_triton"]


@triton.jit
def softmax_no_max(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + tl.program_id(0) * x_row_stride + cols, mask=cols < n_cols, other=float("-inf"))
    e = tl.exp(x)                                                   # exp(200) overflows float32
    tl.store(y_ptr + tl.program_id(0) * y_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def softmax_no_load_mask(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + tl.program_id(0) * x_row_stride + cols)     # reads past the row
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + tl.program_id(0) * y_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def softmax_no_store_mask(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + tl.program_id(0) * x_row_stride + cols, mask=cols < n_cols, other=float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + tl.program_id(0) * y_row_stride + cols, e / tl.sum(e, axis=0))   # writes past the row


@triton.jit
def softmax_nan_on_empty_rows(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + tl.program_id(0) * x_row_stride + cols, mask=cols < n_cols, other=float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))                               # -inf - (-inf) = NaN
    tl.store(y_ptr + tl.program_id(0) * y_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def scores_top_left(q_ptr, k_ptr, s_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + rows[:, None] * d + dims[None, :], mask=(rows[:, None] < nq) & (dims[None, :] < d), other=0.0)
    k = tl.load(k_ptr + cols[:, None] * d + dims[None, :], mask=(cols[:, None] < nk) & (dims[None, :] < d), other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))   # top-left: wrong when nq != nk
    tl.store(s_ptr + rows[:, None] * nk + cols[None, :], s, mask=(rows[:, None] < nq) & (cols[None, :] < nk))


@triton.jit
def scores_first_tile_only(q_ptr, k_ptr, s_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)                                    # forgot tl.program_id
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + rows[:, None] * d + dims[None, :], mask=(rows[:, None] < nq) & (dims[None, :] < d), other=0.0)
    k = tl.load(k_ptr + cols[:, None] * d + dims[None, :], mask=(cols[:, None] < nk) & (dims[None, :] < d), other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None] + (nk - nq), s, float("-inf"))
    tl.store(s_ptr + rows[:, None] * nk + cols[None, :], s, mask=(rows[:, None] < nq) & (cols[None, :] < nk))


@triton.jit
def attention_row_variant(q_ptr, k_ptr, v_ptr, o_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          RESCALE: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """The reference kernel with one step wrong: no rescaling by alpha, or a top-left causal mask."""
    i = tl.program_id(0)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + i * d + dims, mask=dims < d, other=0.0)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(0, nk, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)
        tile = (cols[:, None] < nk) & (dims[None, :] < d)
        k = tl.load(k_ptr + cols[:, None] * d + dims[None, :], mask=tile, other=0.0)
        v = tl.load(v_ptr + cols[:, None] * d + dims[None, :], mask=tile, other=0.0)
        visible = cols < nk
        if CAUSAL:
            if BOTTOM_RIGHT:
                visible = visible & (cols <= i + nk - nq)
            else:
                visible = visible & (cols <= i)
        s = tl.where(visible, tl.sum(q[None, :] * k, axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m - m_safe)
        if not RESCALE:
            alpha = 1.0
        l = alpha * l + tl.sum(p, axis=0)
        acc = alpha * acc + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(o_ptr + i * d + dims, tl.where(l > 0, acc / l, 0.0), mask=dims < d)


def _variant(**flags):
    """attention_row_variant with its flags fixed, launched as the checker launches a reader's kernel."""
    class Variant(triton.runtime.jit.KernelInterface):
        fn = attention_row_variant.fn

        def __getitem__(self, grid):
            return lambda *args, **kw: attention_row_variant[grid](*args, **kw, **flags)
    return Variant()


@triton.jit
def softmax_stub(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK: tl.constexpr):
    pass                                                            # the stub a chapter hands out


@triton.jit
def scores_stub_raises(q_ptr, k_ptr, s_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    raise NotImplementedError


@triton.jit
def flash_forward_variant(q_ptr, k_ptr, v_ptr, o_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          RESCALE: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, KEY_MASK: tl.constexpr):
    """flash_forward_kernel with one step wrong: no rescaling by alpha, a top-left causal mask, or no
    mask on the keys past nk of the last, ragged key block."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_tile = (rows[:, None] < nq) & (dims[None, :] < d)
    q = tl.load(q_ptr + rows[:, None] * d + dims[None, :], mask=q_tile, other=0.0)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for j in range(0, nk, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)
        kv_tile = (cols[:, None] < nk) & (dims[None, :] < d)
        k = tl.load(k_ptr + cols[:, None] * d + dims[None, :], mask=kv_tile, other=0.0)
        v = tl.load(v_ptr + cols[:, None] * d + dims[None, :], mask=kv_tile, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = (cols[None, :] < nk) | (not KEY_MASK)
        if CAUSAL:
            if BOTTOM_RIGHT:
                visible = visible & (cols[None, :] <= rows[:, None] + nk - nq)
            else:
                visible = visible & (cols[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        if not RESCALE:
            alpha = tl.full((BLOCK_M,), 1.0, tl.float32)
        l = alpha * l + tl.sum(p, axis=1)
        acc = alpha[:, None] * acc + tl.dot(p, v)
        m = m_new
    l_safe = tl.where(l > 0, l, 1.0)
    o = tl.where(l[:, None] > 0, acc / l_safe[:, None], 0.0)
    tl.store(o_ptr + rows[:, None] * d + dims[None, :], o, mask=q_tile)


def _flash_variant(**flags):
    """flash_forward_variant with its flags fixed, launched as the checker launches a reader's kernel."""
    class Variant(triton.runtime.jit.KernelInterface):
        fn = flash_forward_variant.fn

        def __getitem__(self, grid):
            return lambda *args, **kw: flash_forward_variant[grid](*args, **kw, **flags)
    return Variant()


@triton.jit
def flash_forward_stub(q_ptr, k_ptr, v_ptr, o_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The stub chapter 7 hands out: the query tile and the running statistics, no loop, no store."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_tile = (rows[:, None] < nq) & (dims[None, :] < d)
    q = tl.load(q_ptr + rows[:, None] * d + dims[None, :], mask=q_tile, other=0.0)  # noqa: F841
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # noqa: F841
    l = tl.zeros((BLOCK_M,), tl.float32)  # noqa: F841
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)  # noqa: F841


WRONG = [
    ("softmax_kernel", softmax_no_max, "case 2 x 100, scores ~200 (row stride 103): y is NaN at row 0"),
    ("softmax_kernel", softmax_no_load_mask, "case 3 x 5 (row stride 8): y: max error"),
    ("softmax_kernel", softmax_no_store_mask, "values past the end of the output (mask the stores"),
    ("softmax_kernel", softmax_nan_on_empty_rows,
     "-inf entries and an all -inf row (row stride 10): y is NaN at row 1"),
    ("scores_kernel", scores_top_left, "wrong on case Nq=5, Nk=7, d=3, causal: s at row 0, column 1: expected"),
    ("attention_row_kernel", _variant(RESCALE=False, BOTTOM_RIGHT=True),
     "wrong on case Nq=7, Nk=20, d=5, causal: o: max error"),
    ("attention_row_kernel", _variant(RESCALE=True, BOTTOM_RIGHT=False),
     "wrong on case Nq=5, Nk=3, d=8, causal: o: max error"),
    ("scores_kernel", scores_first_tile_only,
     "wrong on case Nq=20, Nk=9, d=24, causal: the kernel never stored row 16"),
    ("flash_forward_kernel", _flash_variant(RESCALE=False, BOTTOM_RIGHT=True, KEY_MASK=True),
     "wrong on case Nq=20, Nk=37, d=16: o: max error"),
    ("flash_forward_kernel", _flash_variant(RESCALE=True, BOTTOM_RIGHT=False, KEY_MASK=True),
     "wrong on case Nq=5, Nk=3, d=8, causal: o: max error"),
    ("flash_forward_kernel", _flash_variant(RESCALE=True, BOTTOM_RIGHT=True, KEY_MASK=False),
     "wrong on case Nq=1, Nk=1, d=1: o: max error"),
]


@pytest.mark.parametrize("puzzle", TRITON_PUZZLES, ids=lambda p: p.name)
def test_the_reference_kernel_passes(puzzle):
    result = puzzle.check(puzzle.solution)
    assert result and str(result) == f"✔ {puzzle.name}: correct on {result.cases} cases", result
    assert puzzle.solution is getattr(triton_solutions, puzzle.name)


@pytest.mark.parametrize("name,fn,message", WRONG, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(WRONG)])
def test_a_plausible_wrong_kernel_fails_and_says_why(name, fn, message):
    result = check(name, fn)
    assert result.status == "wrong" and message in str(result), str(result)


def test_every_triton_puzzle_has_a_wrong_kernel_that_fails():
    assert {p.name for p in TRITON_PUZZLES} <= {name for name, _, _ in WRONG}


@pytest.mark.parametrize("name,stub,reason", [
    ("softmax_kernel", softmax_stub, "the kernel stored nothing yet"),
    ("scores_kernel", scores_stub_raises,
     "the kernel body still raises NotImplementedError: write it and run the cell"),
    ("flash_forward_kernel", flash_forward_stub,
     "the kernel stored nothing yet"),
])
def test_a_stub_kernel_is_not_attempted_yet(name, stub, reason):
    result = check(name, stub)
    assert result.status == "not attempted" and str(result) == f"… {name}: not attempted yet ({reason})", result


def test_a_plain_python_function_is_refused_naming_fn():
    def softmax_kernel(*args):
        return None
    with pytest.raises(TypeError, match=r"^fn must be a @triton.jit kernel, got function .*\(decorate it with @triton"):
        check("softmax_kernel", softmax_kernel)
    with pytest.raises(TypeError, match="fn must be a @triton.jit kernel, got int"):
        check("scores_kernel", 3)


def test_the_variant_kernel_with_nothing_left_out_passes():
    """So the wrong variants above fail for the step they leave out, not for the way they are launched."""
    assert check("attention_row_kernel", _variant(RESCALE=True, BOTTOM_RIGHT=True))


def test_the_flash_forward_variant_with_nothing_left_out_passes():
    """So its wrong variants fail for the step they leave out, not for the way they are launched."""
    assert check("flash_forward_kernel", _flash_variant(RESCALE=True, BOTTOM_RIGHT=True, KEY_MASK=True))
