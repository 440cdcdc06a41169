"""Random-LTD's token operations in plain torch (DeepSpeed's are a CUDA op, ``RandomLTDBuilder``):
which tokens a layer keeps, and moving them out of and back into the full sequence.

``gpt_sample_tokens``/``bert_sample_tokens`` draw the kept tokens exactly as DeepSpeed does (one
``torch.multinomial`` over uniform weights for every layer and sample, then sorted), so under the
same torch seed they keep the same tokens (a test compares with DeepSpeed's draw). A decoder keeps
the top-left corner of its causal mask; an encoder gathers its mask's rows and columns.
``GatherTokens``/``ScatterTokens`` are autograd functions: gradients flow back to the kept tokens
only, the dropped ones pass the layer by untouched.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gpt_sample_tokens", "bert_sample_tokens", "token_sort_", "token_gather", "token_scatter_",
           "GatherTokens", "ScatterTokens"]


def token_sort_(indices: torch.Tensor, seq_length: int) -> torch.Tensor:
    """``indices`` ([layers, batch, kept]) sorted ascending along the last dimension (in place)."""
    del seq_length
    indices.copy_(indices.sort(dim=-1).values)
    return indices


def _batch_first(activations: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return activations if batch_first else activations.transpose(0, 1)


def token_gather(activations: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The kept tokens: ``activations`` [batch, seq, hidden] (or [seq, batch, hidden]) at ``indices``
    [batch, kept] -> [batch, kept, hidden] (or [kept, batch, hidden])."""
    view = _batch_first(activations, batch_first)
    index = indices.long().unsqueeze(-1).expand(-1, -1, view.size(-1))
    kept = torch.gather(view, 1, index)
    return kept if batch_first else kept.transpose(0, 1).contiguous()


def token_scatter_(all_activations: torch.Tensor, layer_activations: torch.Tensor, indices: torch.Tensor,
                   batch_first: bool) -> torch.Tensor:
    """``all_activations`` with the kept tokens' rows replaced by ``layer_activations`` (in place)."""
    view = _batch_first(all_activations, batch_first)
    kept = _batch_first(layer_activations, batch_first)
    index = indices.long().unsqueeze(-1).expand(-1, -1, view.size(-1))
    view.scatter_(1, index, kept.to(view.dtype))
    return all_activations


def _draw(reserved_length: int, seq_length: int, batch_size: int, layers: int, device: Any) -> torch.Tensor:
    weights = torch.ones((layers * batch_size, seq_length), device=device)
    drawn = torch.multinomial(weights, reserved_length).reshape(layers, batch_size, reserved_length)
    return token_sort_(drawn.to(torch.int32), seq_length)


def gpt_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1, device: Any = "cpu",
                      attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder's kept tokens ([layers, batch, kept], int32, ascending) and its causal mask cut to
    ``reserved_length`` (None without one)."""
    indices = _draw(reserved_length, seq_length, batch_size, layers, device)
    mask = attn_mask[:, :, :reserved_length, :reserved_length] if attn_mask is not None else None
    return indices, mask


def bert_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1, device: Any = "cpu",
                       attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An encoder's kept tokens and, per layer, its attention mask ([batch, 1, seq, seq]) at them.

    Raises:
        ValueError: no ``attn_mask`` (an encoder's mask must follow its tokens).
    """
    if attn_mask is None:
        raise ValueError("bert_sample_tokens: an encoder needs its attention mask (random_ltd.model_mask_name)")
    indices = _draw(reserved_length, seq_length, batch_size, layers, device)
    picked = indices.long()
    masks = [torch.cat([attn_mask[i:i + 1, :, picked[layer][i], :][:, :, :, picked[layer][i]]
                        for i in range(batch_size)], dim=0) for layer in range(layers)]
    return indices, masks


class GatherTokens(torch.autograd.Function):
    """(all tokens, the kept ones); backward: the kept rows get the kept tokens' gradient."""

    @staticmethod
    def forward(ctx: Any, activations: torch.Tensor, sorted_indices: torch.Tensor,
                batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        return activations, token_gather(activations, sorted_indices, batch_first)

    @staticmethod
    def backward(ctx: Any, a_gradients: torch.Tensor, g_gradients: torch.Tensor) -> tuple:
        (sorted_indices,) = ctx.saved_tensors
        # the kept rows' gradient is the layer's (ScatterTokens passed the output's there too: replaced)
        grads = token_scatter_(a_gradients.clone(), g_gradients.contiguous(), sorted_indices, ctx.batch_first)
        return grads, None, None


class ScatterTokens(torch.autograd.Function):
    """All tokens with the kept ones replaced by the layer's output."""

    @staticmethod
    def forward(ctx: Any, all_activations: torch.Tensor, layer_activations: torch.Tensor,
                sorted_indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        ctx.batch_first = batch_first
        return token_scatter_(all_activations.clone(), layer_activations, sorted_indices, batch_first)

    @staticmethod
    def backward(ctx: Any, out_gradients: torch.Tensor) -> tuple:
        (sorted_indices,) = ctx.saved_tensors
        out_gradients = out_gradients.contiguous()
        # the whole gradient passes to the input; GatherTokens' backward then replaces the kept rows
        return out_gradients, token_gather(out_gradients, sorted_indices, ctx.batch_first), None, None
