"""flashlib's torch ops: the autograd of :func:`flashlib.attention` and the op of :func:`flashlib.decode`
(imported on first use).

With torch >= 2.4, three :mod:`torch.library` custom ops, ``flashlib::attention_fwd``,
``flashlib::attention_bwd`` and ``flashlib::decode``, each with a fake (shape-only) implementation, and
the forward's autograd registered, so that ``torch.compile`` sees ``flashlib.attention`` and
``flashlib.decode`` as one opaque op each, without graph breaks. With an older torch, the same steps as
a plain :class:`torch.autograd.Function` and a plain function. All call a backend of
:mod:`flashlib.backends`, which travels through the ops as its registry name.

A custom op's dispatch costs host time, so :func:`path` sends each call the cheapest way that is still
correct: the op only where the compiler, a dispatch mode, a subclass or a torch.func transform needs it.

Empty batches (B = 0 or H = 0: q holds no element) and meta tensors never reach a backend: as
torch's SDPA does, the forward and decode return ``o`` and ``lse`` of the right shapes and dtypes
(empty, or on the meta device), the backward zeros (empty, or zeros for a k, v that are not empty
when H = 0), on every backend and every way. A kernel could not launch zero programs, nor read a
meta tensor.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import importlib.util
import sys

import torch

from .backends import BACKENDS

# Calling a torch custom op imports triton (torch looks for Triton kernels). Triton's mode is fixed by
# its first import, so flashlib.kernels.triton must choose it first (interpreter when there is no GPU).
if "triton" not in sys.modules and importlib.util.find_spec("triton") is not None:
    from .kernels import triton as _flashlib_triton  # noqa: F401

__all__ = ["attention_op", "decode_op", "varlen_op", "append_op", "Attention", "Varlen", "forward_impl",
           "decode_impl", "varlen_impl", "append_impl", "kernel_kw", "variant_kw", "path"]


def _nothing_to_compute(q) -> bool:
    """B = 0 or H = 0 (q holds no element: no program to launch), or meta tensors (shapes only)."""
    return q.numel() == 0 or q.is_meta


def kernel_kw(name):
    """The keyword a backend gets for a kernel version: none when the caller named none (a backend
    without versions, registered by a user, need not take it)."""
    return {} if name is None else {"kernel": name}


def variant_kw(window_size, softcap, alibi_slopes, sinks, dropout_p=0.0, dropout_seed=None) -> dict:
    """The keywords a backend gets for the attention variants: only those in use (a backend without
    variants, registered by a user, is never passed one). ``window_size`` and ``dropout_seed`` arrive
    as the ops' int lists."""
    kw = {}
    if tuple(window_size) != (-1, -1):
        kw["window_size"] = tuple(window_size)
    if softcap > 0:
        kw["softcap"] = softcap
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        kw["sinks"] = sinks.detach().contiguous()
    if dropout_p > 0:
        kw["dropout_p"] = dropout_p
        kw["dropout_seed"] = tuple(dropout_seed)
    return kw


NO_VARIANTS = ((-1, -1), 0.0, None, None, 0.0, (0, 0))   # the ops' variant arguments when none is used


def forward_impl(q, k, v, causal, scale, allow_tf32, backend, block_q, block_k, kernel_fwd, kernel_bwd,
                 *variants):
    """The forward of the op, and of :func:`flashlib.attention` for eager inference: ``(o, lse)``,
    contiguous (the op's promise: see its fake), from the backend; empty or meta inputs answered
    without one. ``variants``: window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_seed.
    (:class:`Attention`'s forward does the same inline: one frame fewer under autograd.)"""
    variants = variants or NO_VARIANTS
    if _nothing_to_compute(q):
        return _fake_outputs(q)
    o, lse = BACKENDS[backend].forward(q, k, v, causal=causal, scale=scale, allow_tf32=allow_tf32,
                                       blocks=(block_q, block_k), **kernel_kw(kernel_fwd),
                                       **variant_kw(*variants))
    return o.contiguous(), lse.contiguous()


def _bwd_impl(q, k, v, o, lse, do, causal, scale, allow_tf32, backend, block_q, block_k, kernel_fwd,
              kernel_bwd, *variants):
    """``(dq, dk, dv, dsinks)``; ``dsinks`` is empty when there are no sinks (an op returns tensors)."""
    variants = variants or NO_VARIANTS
    sinks = variants[3]
    if _nothing_to_compute(q):                        # no query: no gradient anywhere
        grads = tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        return (*grads, _no_dsinks(q) if sinks is None else torch.zeros_like(sinks))
    grads = BACKENDS[backend].backward(q, k, v, o, lse, do, causal=causal, scale=scale,
                                       allow_tf32=allow_tf32, blocks=(block_q, block_k),
                                       **kernel_kw(kernel_bwd), **variant_kw(*variants))
    dq, dk, dv = (g.contiguous() for g in grads[:3])
    dsinks = _no_dsinks(q) if sinks is None else grads[3].to(sinks.dtype).contiguous()
    return dq, dk, dv, dsinks


def _no_dsinks(q):
    return q.new_zeros((0,), dtype=torch.float32)


def decode_impl(q, k_cache, v_cache, cache_seqlens, num_splits, scale, backend, kernel, *variants,
                block_table=None):
    """The decode of the op: ``(o, lse)``, contiguous, from the backend; empty or meta inputs answered
    without one. ``variants``: window_size, softcap, alibi_slopes, sinks; ``block_table`` (paged
    caches) is passed to the backend only when given."""
    variants = variants or NO_VARIANTS[:4]
    if _nothing_to_compute(q):
        return _fake_outputs(q)
    paged = {} if block_table is None else {"block_table": block_table}
    o, lse = BACKENDS[backend].decode(q, k_cache, v_cache, cache_seqlens, num_splits=num_splits,
                                      scale=scale, **kernel_kw(kernel), **variant_kw(*variants), **paged)
    return o.contiguous(), lse.contiguous()


def _fake_outputs(q):
    """``(o, lse)`` as the ops return them: contiguous, whatever q's strides (torch.compile plans views
    from these strides); lse float32 (float64 stays float64), ``(B, H, Nq)``."""
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=lse_dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs          # causal, scale, allow_tf32, backend, blocks, kernels, variants
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = tuple(args)
    ctx.mark_non_differentiable(lse)                   # lse is an output to read, not to train


def _grads(ctx, dq, dk, dv, dsinks):
    """Autograd's answer for every input of the forward: q, k, v, then None for the arguments, and
    dsinks at the sinks' place (index 11 of the arguments) when sinks need one."""
    nones = [None] * len(ctx.args)              # a caller may leave the variants out: then no sinks
    sinks = ctx.args[11] if len(ctx.args) > 11 else None
    if sinks is not None and sinks.requires_grad:
        nones[11] = dsinks
    return (dq, dk, dv, *nones)


class Attention(torch.autograd.Function):
    """The autograd of attention without a custom op: the eager path when only autograd needs it
    (:func:`path` = "function"), and everything on a torch without :mod:`torch.library` custom ops.
    Its forward calls the backend itself (no frame between: flashlib.attention to the launch is at
    most 6 frames, tests/test_frames.py)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, allow_tf32, backend, block_q, block_k, kernel_fwd, kernel_bwd,
                *variants):
        variants = variants or NO_VARIANTS
        if _nothing_to_compute(q):
            o, lse = _fake_outputs(q)
        else:
            o, lse = BACKENDS[backend].forward(q, k, v, causal=causal, scale=scale, allow_tf32=allow_tf32,
                                               blocks=(block_q, block_k), **kernel_kw(kernel_fwd),
                                               **variant_kw(*variants))
            o, lse = o.contiguous(), lse.contiguous()
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, scale, allow_tf32, backend, block_q, block_k, kernel_fwd, kernel_bwd, *variants)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True. The backends' gradients are constants to autograd (no graph runs through
            # the kernels), so a second backward through them would silently drop its terms. The
            # backward op has no autograd formula: differentiating its outputs is then a clear error
            # ("... flashlib.attention_bwd ... no autograd formula"), as on the op's own way.
            if not hasattr(torch.library, "custom_op"):       # pragma: no cover - torch < 2.4
                raise RuntimeError("flashlib.attention has no double backward (create_graph=True): "
                                   "its backward kernels are not differentiable")
            grads = attention_bwd(q, k, v, o, lse, do.contiguous(), *ctx.args)
        else:
            grads = _bwd_impl(q, k, v, o, lse, do.contiguous(), *ctx.args)
        return _grads(ctx, *grads)


_VARIANT_SCHEMA = ("int[] window_size=[-1, -1], float softcap=0.0, Tensor? alibi_slopes=None,"
                   " Tensor? sinks=None, float dropout_p=0.0, int[] dropout_seed=[0, 0]")

if hasattr(torch.library, "custom_op"):
    # "No choice" (blocks, kernels) is None all the way down: the schema's optional ints and strs.
    @torch.library.custom_op("flashlib::attention_fwd", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool allow_tf32, str backend,"
        " int? block_q, int? block_k, str? kernel_fwd, str? kernel_bwd, " + _VARIANT_SCHEMA +
        ") -> (Tensor, Tensor)"))
    def attention_fwd(q, k, v, causal, scale, allow_tf32, backend, block_q, block_k, kernel_fwd, kernel_bwd,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
                      dropout_seed=(0, 0)):
        return forward_impl(q, k, v, causal, scale, allow_tf32, backend, block_q, block_k, kernel_fwd,
                            kernel_bwd, window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_seed)

    @attention_fwd.register_fake
    def _(q, k, v, *args):
        return _fake_outputs(q)

    @torch.library.custom_op("flashlib::attention_bwd", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, bool causal, float scale,"
        " bool allow_tf32, str backend, int? block_q, int? block_k, str? kernel_fwd, str? kernel_bwd, "
        + _VARIANT_SCHEMA + ") -> (Tensor, Tensor, Tensor, Tensor)"))
    def attention_bwd(q, k, v, o, lse, do, causal, scale, allow_tf32, backend, block_q, block_k, kernel_fwd,
                      kernel_bwd, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                      dropout_p=0.0, dropout_seed=(0, 0)):
        return _bwd_impl(q, k, v, o, lse, do, causal, scale, allow_tf32, backend, block_q, block_k,
                         kernel_fwd, kernel_bwd, window_size, softcap, alibi_slopes, sinks, dropout_p,
                         dropout_seed)

    def _fake_grads(q, k, v, o, lse, do, *args):
        """The backward ops' fake: dq, dk, dv like q, k, v, and dsinks (empty without sinks, at index
        11 of the arguments after do, for attention's and varlen's alike)."""
        sinks = args[11] if len(args) > 11 else None
        dsinks = q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks

    attention_bwd.register_fake(_fake_grads)

    def _backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return _grads(ctx, *attention_bwd(q, k, v, o, lse, do.contiguous(), *ctx.args))

    attention_fwd.register_autograd(_backward, setup_context=_setup_context)
    attention_op = attention_fwd

    # Decode is inference only: no autograd registered (flashlib.decode refuses inputs needing grad).
    @torch.library.custom_op("flashlib::decode", mutates_args=(), schema=(
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cache_seqlens, int num_splits, float scale,"
        " str backend, str? kernel, int[] window_size=[-1, -1], float softcap=0.0, Tensor? alibi_slopes=None,"
        " Tensor? sinks=None, Tensor? block_table=None)"
        " -> (Tensor o, Tensor lse)"))
    def decode_op(q, k_cache, v_cache, cache_seqlens, num_splits, scale, backend, kernel, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, sinks=None, block_table=None):
        return decode_impl(q, k_cache, v_cache, cache_seqlens, num_splits, scale, backend, kernel,
                           window_size, softcap, alibi_slopes, sinks, block_table=block_table)

    @decode_op.register_fake
    def _(q, *args):
        return _fake_outputs(q)

    # Ragged batches (chapter 10): the forward and backward of attention_varlen, as attention's.
    @torch.library.custom_op("flashlib::varlen_fwd", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q,"
        " int max_seqlen_k, bool causal, float scale, bool allow_tf32, str backend, "
        + _VARIANT_SCHEMA + ") -> (Tensor, Tensor)"))
    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, backend,
                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
                   dropout_seed=(0, 0)):
        return varlen_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, backend,
                           window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_seed)

    @varlen_fwd.register_fake
    def _(q, k, v, *args):
        return _fake_varlen_outputs(q)

    @torch.library.custom_op("flashlib::varlen_bwd", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, Tensor cu_seqlens_q,"
        " Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, float scale,"
        " bool allow_tf32, str backend, " + _VARIANT_SCHEMA + ") -> (Tensor, Tensor, Tensor, Tensor)"))
    def varlen_bwd(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, backend,
                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
                   dropout_seed=(0, 0)):
        return _varlen_bwd_impl(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32,
                                backend, window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_seed)

    varlen_bwd.register_fake(_fake_grads)

    def _varlen_backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return _grads(ctx, *varlen_bwd(q, k, v, o, lse, do.contiguous(), *ctx.args))

    varlen_fwd.register_autograd(_varlen_backward, setup_context=_setup_context)
    varlen_op = varlen_fwd

    # Decode's append writes the new tokens into the caller's caches: an op that mutates them.
    @torch.library.custom_op("flashlib::append_kv", mutates_args=("k_cache", "v_cache"), schema=(
        "(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor cache_seqlens,"
        " Tensor? block_table) -> ()"))
    def append_op(k_cache, v_cache, k, v, cache_seqlens, block_table=None):
        append_impl(k_cache, v_cache, k, v, cache_seqlens, block_table)

    @append_op.register_fake
    def _(*args):
        return None

else:  # pragma: no cover - torch < 2.4
    attention_op = Attention.apply
    decode_op = decode_impl
    varlen_op = None                                   # set below, after Varlen
    append_op = None


def _fake_varlen_outputs(q):
    """``(o, lse)`` of a ragged batch: o like q ``(total_q, H, d)``, lse ``(H, total_q)`` float32."""
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


def varlen_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, backend, *variants):
    """The forward of a ragged batch (:func:`flashlib.attention_varlen`): ``(o (total_q, H, d),
    lse (H, total_q))``, contiguous, from the backend's ``forward_varlen``; no token or no head
    answered without one."""
    variants = variants or NO_VARIANTS
    if _nothing_to_compute(q):
        return _fake_varlen_outputs(q)
    o, lse = BACKENDS[backend].forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                              scale=scale, allow_tf32=allow_tf32, **variant_kw(*variants))
    return o.contiguous(), lse.contiguous()


def _varlen_bwd_impl(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, backend,
                     *variants):
    """``(dq, dk, dv, dsinks)`` of a ragged batch; ``dsinks`` empty when there are no sinks."""
    variants = variants or NO_VARIANTS
    sinks = variants[3]
    if _nothing_to_compute(q):
        grads = tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        return (*grads, _no_dsinks(q) if sinks is None else torch.zeros_like(sinks))
    grads = BACKENDS[backend].backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal=causal,
                                              scale=scale, allow_tf32=allow_tf32, **variant_kw(*variants))
    dq, dk, dv = (g.contiguous() for g in grads[:3])
    dsinks = _no_dsinks(q) if sinks is None else grads[3].to(sinks.dtype).contiguous()
    return dq, dk, dv, dsinks


class Varlen(torch.autograd.Function):
    """The autograd of :func:`flashlib.attention_varlen` without a custom op (eager, when only
    autograd needs a backward): :class:`Attention`'s, for packed sequences. Its arguments after q, k,
    v put ``sinks`` at index 11, as attention's do (:func:`_grads`)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, backend, *variants):
        o, lse = varlen_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, backend,
                             *variants)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, backend, *(variants or NO_VARIANTS))
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if torch.is_grad_enabled():                    # create_graph=True: no double backward
            raise RuntimeError("flashlib.attention_varlen has no double backward (create_graph=True): "
                               "its backward kernels are not differentiable")
        return _grads(ctx, *_varlen_bwd_impl(q, k, v, o, lse, do.contiguous(), *ctx.args))


if varlen_op is None:  # pragma: no cover - torch < 2.4
    varlen_op = Varlen.apply


def append_impl(k_cache, v_cache, k, v, cache_seqlens, block_table=None) -> None:
    """Write the new tokens ``k, v`` into the caches in place at positions ``cache_seqlens[b] + i``
    (:func:`flashlib.append_kv`): on a CUDA device, Triton's append kernel
    (:func:`flashlib.kernels.triton.decode_v3.append_kv`: no host read-back, positions past the
    capacity not written); elsewhere torch's indexing (the API checked the capacity first)."""
    if k.numel() == 0:
        return
    if k_cache.device.type == "cuda":
        from .kernels.triton import decode_v3
        decode_v3.append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
        return
    B = k.shape[0]
    n_new = k.shape[1] if block_table is not None else k.shape[2]
    pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(n_new, device=k.device)   # (B, Nnew)
    b = torch.arange(B, device=k.device)[:, None].expand(B, n_new)                       # (B, Nnew)
    if block_table is None:                 # dense (B, Hkv, Nmax, d): [b, :, pos] is (B, Nnew, Hkv, d)
        k_cache[b, :, pos] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache[b, :, pos] = v.transpose(1, 2).to(v_cache.dtype)
    else:                                   # paged (pages, page_size, Hkv, d): token t -> page, row
        page_size = k_cache.shape[1]
        page = block_table.to(torch.int64).gather(1, pos // page_size)                  # (B, Nnew)
        k_cache[page, pos % page_size] = k.to(k_cache.dtype)
        v_cache[page, pos % page_size] = v.to(v_cache.dtype)


def path(*tensors) -> str:
    """How a call on ``tensors`` (None entries ignored) reaches its backend, the cheapest correct way:

    * ``"op"``: through the custom op (:data:`attention_op`, :data:`decode_op`) when torch.compile
      traces the call (the compiler must see one opaque op), a tensor is a subclass (FakeTensor,
      DTensor, ...), a torch.func transform is active, or a dispatch mode (FakeTensorMode,
      FlopCounterMode, ...) is on the stack; also on a torch too old to tell (to be safe);
    * ``"function"``: through the plain :class:`torch.autograd.Function` when only autograd needs a
      backward (eager plain tensors, one of which requires grad while grad is enabled): the op's
      dispatch costs several times the Function's host time (measured on a CPU with a backend that
      computes nothing: forward 114 against 23 µs, forward and backward 336 against 129 µs);
    * ``"backend"``: the backend directly, when nothing needs either (eager inference).

    Explained in: notebooks/07_triton.
    Tested in: tests/test_ops.py.
    """
    if torch.compiler.is_compiling():
        return "op"
    present = [t for t in tensors if t is not None]
    if any(type(t) is not torch.Tensor for t in present):
        return "op"
    transforms = getattr(torch._C, "_are_functorch_transforms_active", None)
    modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
    if transforms is None or modes is None or transforms() or modes() > 0:
        return "op"
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return "function"
    return "backend"
