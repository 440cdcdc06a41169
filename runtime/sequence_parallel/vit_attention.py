"""``UlyssesSPViTAttention``: a vision encoder's attention over a patch sequence split between the
ranks of a sequence group (``deepspeed.sequence.autosp_vit``).

Vision attention is bidirectional (every patch attends to every patch) and the wrapped module is
opaque (it maps ``hidden_states`` to ``hidden_states``, projections inside), so, as DeepSpeed's,
the wrapper gathers the patches of every rank (``gather.gather_sequence``), runs the module on the
whole sequence and keeps this rank's rows of the output: the attention is exact, and every layer
outside it (norms, MLP) holds only the rank's shard. A ``[CLS]`` token, when the model has one,
is the first position on every rank (replicated, not split) and is given to the module once.

Shards may differ in length (``num_patches`` that the group does not divide, rank order
contiguous); ranks whose tensors differ outside the sequence dimension get one error naming both.

Gradients: each rank's loss reaches every rank's patches through the attention; the gather's
backward returns each rank the sum over ranks for its own patches, so the gradients summed over
the group (the engine averages over data x sequence) are those of the unsplit model when the
ranks' losses add up to its loss (count a replicated ``[CLS]`` term once over the group).
DeepSpeed 0.19.8's gather has no backward: there no gradient reaches the patches through it.
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.runtime.sequence_parallel.gather import gather_sequence

__all__ = ["UlyssesSPViTAttention"]

_SEQ = 1  # [batch, sequence, hidden], as Hugging Face's vision towers lay out hidden states


class UlyssesSPViTAttention(torch.nn.Module):
    """``attn`` run on the whole patch sequence of the group, returning this rank's rows.

    Args:
        attn: the vision attention (``attn(hidden_states, *args, **kwargs)`` returning the output
            tensor or a tuple whose first element is it, e.g. ``(output, weights)``).
        process_group: the sequence-parallel group (``groups._get_sequence_parallel_group()``).
        has_cls_token: the first position of every rank's input is a ``[CLS]`` token, the same on
            every rank.

    ``forward(hidden_states, *args, **kwargs)``: ``hidden_states`` is ``[batch, local, hidden]``
    (``local`` = 1 + this rank's patches with a ``[CLS]`` token); the other arguments go to
    ``attn`` unchanged, so an ``attention_mask`` must cover the whole sequence. Returns what
    ``attn`` returns with its output cut to this rank's rows (extra tuple elements unchanged).

    collective: ``forward`` and its backward on every rank of ``process_group``.

    Raises (from ``forward``):
        UsageError: the ranks' inputs differ in batch or hidden size.
    """

    def __init__(self, attn: torch.nn.Module, process_group: Any, has_cls_token: bool = True) -> None:
        import torch.distributed as dist

        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.has_cls_token = has_cls_token

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        head = 1 if self.has_cls_token else 0
        patches, layout = gather_sequence(hidden_states[:, head:], _SEQ, self.process_group,
                                          f"{type(self).__name__}({type(self.attn).__name__})")
        full = torch.cat([hidden_states[:, :head], patches], dim=_SEQ)
        out = self.attn(full, *args, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        mine = torch.cat([first[:, :head], first[:, head + layout.start:head + layout.start + layout.length]],
                         dim=_SEQ)
        return (mine, *out[1:]) if isinstance(out, (tuple, list)) else mine
