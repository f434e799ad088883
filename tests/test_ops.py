"""flashlib._ops (torch.library custom ops): a module calling flashlib.attention compiles with no graph break.

On conftest's DEVICE: the op runs the compiled Triton kernels on a GPU machine, the reference on a CPU.
"""
import torch

import flashlib
from conftest import DEVICE


class Block(torch.nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.qkv, self.h = torch.nn.Linear(d, 3 * d), h

    def forward(self, x):                                        # (B, N, C)
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        return flashlib.attention(q, k, v, causal=True).transpose(1, 2).reshape(b, n, c)


def test_dynamo_explain_finds_no_graph_break():
    m, x = Block().to(DEVICE), torch.randn(2, 7, 16, device=DEVICE)
    explain = torch._dynamo.explain(m)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1


def test_compiled_module_matches_eager_forward_and_backward():
    torch._dynamo.reset()
    m, x = Block().to(DEVICE), torch.randn(2, 7, 16, device=DEVICE, requires_grad=True)
    eager = m(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    (g_comp,) = torch.autograd.grad(compiled.sum(), x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(g_comp, g_eager)
