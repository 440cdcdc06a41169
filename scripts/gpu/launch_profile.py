"""Where the CPU time of one Triton LayerNorm forward + backward goes (cProfile, 100 calls)."""

import cProfile
import pstats

import torch

from dslaunch.ops.normalization import layer_norm

x = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)


def run(n: int) -> None:
    for _ in range(n):
        torch.autograd.grad(layer_norm(x, w, b, 1e-5), [x, w, b], dy)


run(5)
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
run(100)
torch.cuda.synchronize()
prof.disable()
stats = pstats.Stats(prof).sort_stats("tottime")
stats.print_stats(22)
stats.sort_stats("cumulative").print_stats(22)
