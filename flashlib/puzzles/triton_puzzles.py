"""The Triton puzzles of chapter 7: the checker launches the reader's ``@triton.jit`` kernel itself.

On a machine without a GPU the kernel runs in Triton's interpreter on CPU tensors; with one, it is
compiled and runs on the GPU (:mod:`flashlib.kernels.triton` chooses, before triton is first imported).
Every buffer the kernel gets is a view into a larger one whose tail holds a sentinel, so the checker also
sees a store past the end (a missing store mask) and an element never stored (a grid too small). Loads
past the end read a large filler value, which makes a missing load mask give a wrong answer rather than a
lucky right one. torch and triton are imported only when a Triton puzzle is checked.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import testing
from ..ladder import softmax
from ..ladder.masks import causal_mask
from .core import Case, Puzzle, WrongAnswer

__all__ = ["PUZZLES"]

SOL = "flashlib.puzzles.triton_solutions:"
SENTINEL = -12345.0          # what an output holds before the kernel stores it
FILLER = 1.0e4               # what a load past the end of an input reads
PAD = 4096                   # elements of slack after every buffer


def _accepts_kernel(fn):
    from ..kernels import triton as ft                   # sets TRITON_INTERPRET on a CPU before triton loads
    if not isinstance(fn, ft.triton.runtime.jit.KernelInterface):
        hint = " (decorate it with @triton.jit)" if callable(fn) else ""
        raise TypeError(f"fn must be a @triton.jit kernel, got {type(fn).__name__} {fn!r:.60}{hint}")


def _buffer(array, fill, device):
    """A float32 tensor holding ``array``, as a view into a buffer with PAD elements of ``fill`` after it."""
    import torch
    flat = np.full(array.size + PAD, fill, dtype=np.float32)
    flat[:array.size] = array.ravel()
    buf = torch.from_numpy(flat).to(device)
    return buf, buf[:array.size].view(array.shape)


def _launch(fn, grid, inputs, out_shape, *args, **constexprs):
    """Launch ``fn[grid](*inputs, out, *args, **constexprs)``; the output as float64, or what went wrong."""
    import torch
    from ..kernels import triton as ft
    device = "cpu" if ft.INTERPRET else "cuda"
    tensors = [_buffer(x, FILLER, device)[1] for x in inputs]
    out_buf, out = _buffer(np.full(out_shape, SENTINEL, np.float32), SENTINEL, device)
    fn[grid](*tensors, out, *args, **constexprs)
    if device == "cuda":
        torch.cuda.synchronize()
    flat = out_buf.cpu().numpy().astype(np.float64)
    result, tail = flat[:out.numel()].reshape(out_shape), flat[out.numel():]
    if (tail != SENTINEL).any():
        raise WrongAnswer(f"the kernel stored {int((tail != SENTINEL).sum())} values past the end of the "
                          f"output (mask the stores to the rows and columns that exist)")
    unset = result == SENTINEL
    if unset.all():
        raise NotImplementedError("the kernel stored nothing yet")
    if unset.any():
        r, c = np.argwhere(unset)[0]
        raise WrongAnswer(f"the kernel never stored row {r}, column {c} of the output (does the grid or "
                          f"the store mask miss it?)")
    return result


# ---- a row softmax -------------------------------------------------------------------------------

@functools.cache
def _softmax_cases():
    rng = np.random.default_rng(7)
    partly = rng.standard_normal((3, 7))
    partly[0, 2:] = -np.inf                                       # a causal row: sees 2 of 7
    partly[1] = -np.inf                                           # sees nothing: zeros, not NaN
    arrays = {"1 x 1": rng.standard_normal((1, 1)), "3 x 5": rng.standard_normal((3, 5)),
              "4 x 33": rng.standard_normal((4, 33)), "2 x 100, scores ~200": 200 + 3 * rng.standard_normal((2, 100)),
              "3 x 7, -inf entries and an all -inf row": partly, "5 x 64": rng.standard_normal((5, 64))}
    return [Case(f"{label} (row stride {x.shape[1] + 3})", (x.astype(np.float32),),
                 softmax.safe_softmax(x.astype(np.float32).astype(np.float64))) for label, x in arrays.items()]


def _run_softmax(fn, case):
    import triton
    (x,) = case.args
    rows, n = x.shape
    wide = np.full((rows, n + 3), FILLER, np.float32)             # x is the left part of a wider array
    wide[:, :n] = x
    return _launch(fn, (rows,), [wide], (rows, n), n, n + 3, n, BLOCK=triton.next_power_of_2(n))


# ---- one tile grid of scores ---------------------------------------------------------------------

@functools.cache
def _scores_cases():
    rng = np.random.default_rng(8)
    cases = []
    for nq, nk, d, causal in [(1, 1, 1, False), (5, 7, 3, True), (20, 9, 24, True), (9, 20, 16, True),
                              (33, 17, 8, False), (17, 33, 5, True)]:
        q = rng.standard_normal((nq, d)).astype(np.float32)
        k = rng.standard_normal((nk, d)).astype(np.float32)
        s = d ** -0.5 * q.astype(np.float64) @ k.astype(np.float64).T
        if causal:
            s = np.where(causal_mask(0, nq, 0, nk, nq, nk), s, -np.inf)
        cases.append(Case(f"Nq={nq}, Nk={nk}, d={d}" + (", causal" if causal else ""), (q, k, causal), s))
    return cases


def _run_scores(fn, case):
    import triton
    q, k, causal = case.args
    (nq, d), nk = q.shape, len(k)
    grid = (triton.cdiv(nq, 16), triton.cdiv(nk, 16))
    return _launch(fn, grid, [q, k], (nq, nk), nq, nk, d, d ** -0.5, CAUSAL=causal,
                   BLOCK_M=16, BLOCK_N=16, BLOCK_D=max(16, triton.next_power_of_2(d)))


# ---- one query's attention, key block by key block -----------------------------------------------

@functools.cache
def _attention_row_cases():
    cases = []
    for n, (nq, nk, d, causal, boost) in enumerate([(1, 1, 1, False, 1.0), (1, 37, 16, False, 1.0),
                                                    (5, 3, 8, True, 1.0), (7, 20, 5, True, 1.0),
                                                    (3, 64, 24, False, 30.0), (4, 33, 12, True, 1.0)]):
        q, k, v = testing.random_qkv(nq, nk, d, dtype=np.float32, seed=90 + n)
        q = (boost * q).astype(np.float32)
        cases.append(Case(f"Nq={nq}, Nk={nk}, d={d}" + (", causal" if causal else "")
                          + (", scores in the hundreds" if boost > 1 else ""),
                          (q, k, v, causal), testing.reference(q, k, v, causal=causal)[0]))
    return cases


def _run_attention_row(fn, case):
    import triton
    q, k, v, causal = case.args
    (nq, d), nk = q.shape, len(k)
    return _launch(fn, (nq,), [q, k, v], (nq, d), nq, nk, d, d ** -0.5, CAUSAL=causal,
                   BLOCK_N=16, BLOCK_D=triton.next_power_of_2(d))


# ---- a tiled FlashAttention forward: one program per query block -------------------------------

@functools.cache
def _flash_forward_cases():
    cases = []
    for n, (nq, nk, d, causal, boost) in enumerate([(1, 1, 1, False, 1.0), (20, 37, 16, False, 1.0),
                                                    (5, 3, 8, True, 1.0), (33, 20, 5, True, 1.0),
                                                    (17, 64, 24, False, 30.0), (40, 33, 12, True, 1.0)]):
        q, k, v = testing.random_qkv(nq, nk, d, dtype=np.float32, seed=120 + n)
        q = (boost * q).astype(np.float32)
        cases.append(Case(f"Nq={nq}, Nk={nk}, d={d}" + (", causal" if causal else "")
                          + (", scores in the hundreds" if boost > 1 else ""),
                          (q, k, v, causal), testing.reference(q, k, v, causal=causal)[0]))
    return cases


def _run_flash_forward(fn, case):
    import triton
    q, k, v, causal = case.args
    (nq, d), nk = q.shape, len(k)
    return _launch(fn, (triton.cdiv(nq, 16),), [q, k, v], (nq, d), nq, nk, d, d ** -0.5, CAUSAL=causal,
                   BLOCK_M=16, BLOCK_N=16, BLOCK_D=max(16, triton.next_power_of_2(d)))


C7 = "notebooks/07_triton"
_KERNEL = dict(accepts=_accepts_kernel,
               not_attempted_hint="the kernel body still raises NotImplementedError: write it and run the cell")

PUZZLES = [
    Puzzle("softmax_kernel", C7, "A row softmax kernel", " ".join("""
        Write a kernel that is launched with one program per row, on `grid = (rows,)`. Each program loads its
        row of `x` (`n_cols` floats, starting at `x_ptr + row * x_row_stride`) as one block of
        `BLOCK >= n_cols` lanes. Mask the lanes `>= n_cols` and load them as `-inf`. Store the row's softmax
        at `y_ptr + row * y_row_stride`. Some scores are about 200, where float32 `exp` overflows, and a
        row of all `-inf` must give zeros, not NaN.""".split()),
           "softmax_kernel(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK: tl.constexpr)",
           ("y",), lambda: list(_softmax_cases()), SOL + "softmax_kernel", call=_run_softmax,
           atol=1e-5, rtol=1e-4, **_KERNEL),
    Puzzle("scores_kernel", C7, "A grid of masked score tiles", " ".join("""
        Write `S = scale * Q K^T` for row-major `q (nq, d)` and `k (nk, d)` into `s (nq, nk)`. The kernel is
        launched on `grid = (cdiv(nq, BLOCK_M), cdiv(nk, BLOCK_N))`, one program per
        `BLOCK_M x BLOCK_N` tile. Load the Q and K tiles with masks, padding the head dim to
        `BLOCK_D >= d`, and use `tl.dot`. When `CAUSAL` is set, store `-inf` where key `j > i + nk - nq`
        (bottom-right). Store only the rows and columns that exist. On a GPU, `tl.dot` on float32 may use
        TF32, so the tolerance is 1e-2.""".split()),
           "scores_kernel(q_ptr, k_ptr, s_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr, "
           "BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr)",
           ("s",), lambda: list(_scores_cases()), SOL + "scores_kernel", call=_run_scores,
           atol=1e-2, rtol=1e-2, **_KERNEL),
    Puzzle("attention_row_kernel", C7, "One query's attention, one key block at a time", " ".join("""
        Write a kernel with one program per query, launched on `grid = (nq,)`. Query `i` is row `i` of the
        row-major `q (nq, d)`; `k` and `v` are `(nk, d)`. Walk the keys `BLOCK_N` at a time with the online
        softmax: keep the running max `m`, the sum `l` and the accumulator `acc` of shape `(BLOCK_D,)`, and
        rescale `l` and `acc` by `exp(m_old - m_new)` whenever the max grows. At the end store
        `acc / l` in row `i` of `o (nq, d)`. Mask the keys `>= nk`, and when `CAUSAL` is set also the keys
        `j > i + nk - nq`. A query that sees no key outputs zeros, and some scores are in the hundreds.
        With one query per program, `tl.sum(q[None, :] * k, axis=1)` gives the scores, since `tl.dot`
        wants at least 16 rows.""".split()),
           "attention_row_kernel(q_ptr, k_ptr, v_ptr, o_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr, "
           "BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr)",
           ("o",), lambda: list(_attention_row_cases()), SOL + "attention_row_kernel", call=_run_attention_row,
           atol=1e-4, rtol=1e-4, **_KERNEL),
    Puzzle("flash_forward_kernel", C7, "A tiled FlashAttention forward", " ".join("""
        The last step of the ladder: FlashAttention-2's forward with one program per block of `BLOCK_M`
        queries, launched on `grid = (cdiv(nq, BLOCK_M),)`. `q (nq, d)`, `k, v (nk, d)` and `o (nq, d)`
        are row-major. The stub loads the query tile `Q_i` (padded to `BLOCK_D >= d` columns, rows past
        `nq` as 0) and starts `m = -inf`, `l = 0`, `acc = 0` for its `BLOCK_M` rows. Write the inner loop
        over the key blocks, `BLOCK_N` keys at a time: load `K_j` and `V_j` with masks, compute
        `S = scale * Q_i K_j^T` with `tl.dot`, set to `-inf` the keys `>= nk` and, when `CAUSAL` is set,
        the keys `j > i + nk - nq` (bottom-right), then take one online-softmax step per row, as in
        puzzle 7.3 but for a whole tile (`tl.dot(p, v)` for the values). Then store `acc / l` in the
        rows of `o` that exist; a row that sees no key stores zeros. The shapes are divisible by no block,
        and some scores are in the hundreds. On a GPU, `tl.dot` on float32 may use TF32, so the
        tolerance is 1e-2.""".split()),
           "flash_forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, nq, nk, d, scale, CAUSAL: tl.constexpr, "
           "BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr)",
           ("o",), lambda: list(_flash_forward_cases()), SOL + "flash_forward_kernel", call=_run_flash_forward,
           atol=1e-2, rtol=1e-2, **_KERNEL),
]
