"""flashlib's torch ops: the autograd layer of :func:`flashlib.attention` (imported on first use).

With torch >= 2.4, two :mod:`torch.library` custom ops, ``flashlib::attention_fwd`` and
``flashlib::attention_bwd``, each with a fake (shape-only) implementation and the forward's autograd
registered, so that ``torch.compile`` sees ``flashlib.attention`` as one opaque op, without graph
breaks. With an older torch, the same two steps as a plain :class:`torch.autograd.Function`. The
backend travels as its name in :data:`flashlib.api.BACKENDS`.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import importlib.util
import sys

import torch

from .api import _bwd_impl, _fwd_impl, _lse_dtype, _setup_context

# Calling a torch custom op imports triton (torch looks for Triton kernels). Triton's mode is fixed by
# its first import, so flashlib.kernels.triton must choose it first (interpreter when there is no GPU).
if "triton" not in sys.modules and importlib.util.find_spec("triton") is not None:
    from .kernels import triton as _flashlib_triton  # noqa: F401

__all__ = ["attention_op"]

if hasattr(torch.library, "custom_op"):
    @torch.library.custom_op("flashlib::attention_fwd", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool allow_tf32, str backend,"
        " int block_q, int block_k) -> (Tensor, Tensor)"))
    def attention_fwd(q, k, v, causal, scale, allow_tf32, backend, block_q, block_k):
        return _fwd_impl(q, k, v, causal, scale, allow_tf32, backend, block_q, block_k)

    @attention_fwd.register_fake
    def _(q, k, v, causal, scale, allow_tf32, backend, block_q, block_k):
        # Contiguous, whatever q's strides: the real op returns contiguous tensors too, and
        # torch.compile plans views from these strides.
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))

    @torch.library.custom_op("flashlib::attention_bwd", mutates_args=(), schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, bool causal, float scale,"
        " bool allow_tf32, str backend, int block_q, int block_k) -> (Tensor, Tensor, Tensor)"))
    def attention_bwd(q, k, v, o, lse, do, causal, scale, allow_tf32, backend, block_q, block_k):
        return _bwd_impl(q, k, v, o, lse, do, causal, scale, allow_tf32, backend, block_q, block_k)

    @attention_bwd.register_fake
    def _(q, k, v, o, lse, do, causal, scale, allow_tf32, backend, block_q, block_k):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_bwd(q, k, v, o, lse, do.contiguous(), *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None

    attention_fwd.register_autograd(_backward, setup_context=_setup_context)
    attention_op = attention_fwd

else:  # pragma: no cover - torch < 2.4
    class _Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale, allow_tf32, backend, block_q, block_k):
            o, lse = _fwd_impl(q, k, v, causal, scale, allow_tf32, backend, block_q, block_k)
            _setup_context(ctx, (q, k, v, causal, scale, allow_tf32, backend, block_q, block_k),
                           (o, lse))
            return o, lse

        @staticmethod
        def backward(ctx, do, _dlse):
            q, k, v, o, lse = ctx.saved_tensors
            return (*_bwd_impl(q, k, v, o, lse, do, *ctx.args), None, None, None, None, None, None)

    attention_op = _Attention.apply
