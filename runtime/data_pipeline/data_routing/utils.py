"""``deepspeed.runtime.data_pipeline.data_routing.utils``: DeepSpeed's per-sample helpers for a
batch-first decoder: keep ``reserved_length`` random tokens of each sample (in order) and put the
layer's output back."""

from __future__ import annotations

import torch

__all__ = ["bsh_decoder_gather", "bsh_decoder_scatter"]


def bsh_decoder_gather(reserved_length: int, hidden_states: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(the kept tokens [batch, kept, hidden], each sample's kept positions, the mask cut to them)."""
    kept = [torch.randperm(hidden_states.size(1), device=hidden_states.device)[:reserved_length].sort()[0]
            for _ in range(hidden_states.size(0))]
    part = torch.cat([hidden_states[k:k + 1, rows, :] for k, rows in enumerate(kept)], dim=0)
    return part, kept, mask[:, :, :reserved_length, :reserved_length]


def bsh_decoder_scatter(hidden_states: torch.Tensor, part_hidden_states: torch.Tensor,
                        rand_list: list[torch.Tensor]) -> torch.Tensor:
    """``hidden_states`` with each sample's kept rows replaced (in place)."""
    for k, rows in enumerate(rand_list):
        hidden_states[k, rows, :] = part_hidden_states[k, :, :]
    return hidden_states
