"""A tiny MoE network for the distributed tests, built the same way at every expert-parallel size.

Expert ``g`` (global index) gets the same weights whichever rank holds it, so a run at ep 2 or 4
can be compared with a one-process run that holds every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dslaunch.moe.layer import MoE

HIDDEN, EXPERTS, TOKENS, CLASSES = 8, 4, 16, 3


@dataclass(frozen=True)
class MoECase:
    k: int
    use_residual: bool
    drop_tokens: bool

    @property
    def label(self) -> str:
        return f"top{self.k}{'-residual' if self.use_residual else ''}{'-drop' if self.drop_tokens else ''}"


CASES = [MoECase(k, residual, drop) for k in (1, 2) for residual in (False, True) for drop in (False, True)]


class TinyMoENet(torch.nn.Module):
    """Linear, MoE, Linear; ``forward(x, y)`` is the cross-entropy loss plus 0.01 * ``l_aux``."""

    def __init__(self, case: MoECase, ep_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Tanh(),
                                     torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=case.k, min_capacity=2,
                       use_residual=case.use_residual, drop_tokens=case.drop_tokens, use_rts=False,
                       top2_2nd_expert_sampling=False)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_expert_weights(self, first_global: int) -> None:
        """Local expert ``j`` gets global expert ``first_global + j``'s weights."""
        with torch.no_grad():
            for j, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                gen = torch.Generator().manual_seed(100 + first_global + j)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(self.inp(x))
        self.last = (out.detach(), l_aux.detach())
        return torch.nn.functional.cross_entropy(self.head(out), y) + 0.01 * l_aux


def batch(rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens at ``step``: skewed toward a few directions so experts overfill."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen) * 1.5 + torch.linspace(-1, 1, HIDDEN) * 2
    return x, torch.randint(0, CLASSES, (TOKENS,), generator=gen)


def expert_index(name: str, first_global: int) -> str:
    """``name`` of a local expert parameter renamed to its global expert index."""
    head, sep, tail = name.partition("deepspeed_experts.")
    if not sep:
        return name
    local, _, rest = tail.partition(".")
    return f"{head}{sep}{first_global + int(local)}.{rest}"
