"""Experts whose gradients do not depend on the expert-parallel layout (``layout_invariant``).

Think of the global batch as slots (one micro batch of one data rank each); a gradient is a sum over
slots. After the dispatch all-to-all a local expert's rows arrive in blocks, one per source rank of
the expert group, i.e. one per slot. ``run_by_source`` computes each block as its own call of the
expert on only its real rows (with ``drop_tokens=False`` the padded capacity is the expert group's
busiest count, and padding rows would change the matmul's shape and so its blocking), and every
expert parameter's gradient is the pairwise tree over the blocks (``tree_sum``, by source rank):
autograd's own accumulation of a parameter used in several calls is a chain, not a tree.

Then the expert-data reduction (a fixed tree over the expert groups, ``zero.exchange.TreeAllReduce``)
and the accumulation over micro steps (``zero.gradients``) complete the same tree over all slots
that another expert-parallel degree, data degree or accumulation count builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

__all__ = ["tree_sum", "run_by_source"]


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


def tree_sum(parts: Sequence[Tensor | None]) -> Tensor | None:
    """The pairwise tree ``((p0 + p1) + (p2 + p3)) + ...`` over ``parts`` in order; None counts as
    zero (a block with no rows), and all None is None."""
    level = list(parts)
    while len(level) > 1:
        level = [_add(level[i], level[i + 1]) if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0] if level else None


class _Fanout(torch.autograd.Function):
    """``n`` aliases of a parameter, one per block; the backward sums their gradients in one tree
    (``tree_sum``) instead of autograd's chain of accumulations."""

    @staticmethod
    def forward(ctx: Any, n: int, param: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused alias (empty block) gives None, not zeros
        return tuple(param.view_as(param) for _ in range(n))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, Tensor | None]:
        return None, tree_sum(grads)


def _aliases(expert: torch.nn.Module, n: int) -> list[dict[str, Tensor]]:
    """Per block, ``expert``'s parameters by name: tree-summed aliases of the trainable ones."""
    named = list(expert.named_parameters())
    fans = [_Fanout.apply(n, p) if p.requires_grad else (p,) * n for _, p in named]
    return [{name: fan[b] for (name, _), fan in zip(named, fans, strict=True)} for b in range(n)]


def run_by_source(experts: torch.nn.ModuleList, inputs: Tensor, rows: Tensor) -> Tensor:
    """The local experts' outputs ``[ep, local, C, M]`` for ``inputs`` of that shape: block
    ``[b, j]`` is expert ``j`` on the first ``rows[b, j]`` rows of source rank ``b``'s block (the
    routed tokens; ``rows`` ``[ep, local]``), its padding rows zero."""
    sources, _, capacity, _ = inputs.shape
    counts = rows.tolist()
    out = []
    for j, expert in enumerate(experts):
        params = _aliases(expert, sources)
        blocks = []
        for b in range(sources):
            n = min(int(counts[b][j]), capacity)
            # zeros made from the (zero) padding rows: the output depends on every input block even
            # where no token came, so every rank's backward runs the dispatch's exchange
            pad = inputs[b, j, n:] * 0
            if not n:
                blocks.append(pad)
                continue
            y = functional_call(expert, params[b], (inputs[b, j, :n],))
            y = y[0] if isinstance(y, tuple) else y  # (output, bias) experts: the output
            blocks.append(torch.cat([y, pad]) if n < capacity else y)
        out.append(torch.stack(blocks))
    return torch.stack(out, dim=1)
