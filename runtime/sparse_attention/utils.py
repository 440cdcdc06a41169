"""``SparseAttentionUtils``: fitting a BERT or RoBERTa model to block-sparse attention.

DeepSpeed's static helpers: longer position embeddings (the trained ones repeated), the
tokenizer's maximum length, each encoder layer's self-attention swapped for
``BertSparseSelfAttention`` (keeping the trained query/key/value projections), and padding the
inputs to a multiple of the block size (then cutting the padding off the output).

Differences from DeepSpeed: ``replace_model_self_attention_with_sparse_self_attention`` works on
a model that is not DeepSpeed's own BERT (DeepSpeed calls a method of that name on the model,
which Hugging Face models do not have); the messages go to the DeepSpeed logger, not ``print``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812 (torch's usual alias)

from dslaunch.errors import SparsityConfigError
from dslaunch.runtime.sparse_attention.attention import BertSparseSelfAttention
from dslaunch.runtime.sparse_attention.layouts import SparsityConfig
from dslaunch.utils.logging import logger

__all__ = ["SparseAttentionUtils"]

_ONLY = "supports models with a 'bert' or 'roberta' attribute (Hugging Face BERT and RoBERTa)"


def _positions(model: Any) -> tuple[torch.nn.Embedding, int]:
    """The position embedding and how many leading rows are reserved (RoBERTa: 2)."""
    if hasattr(model, "bert"):
        return model.bert.embeddings.position_embeddings, 0
    if hasattr(model, "roberta"):
        return model.roberta.embeddings.position_embeddings, 2
    raise SparsityConfigError(f"extend_position_embedding {_ONLY}; extend it for {type(model).__name__}")


class SparseAttentionUtils:
    """Helpers to put block-sparse self-attention into a pretrained transformer."""

    @staticmethod
    def extend_position_embedding(model: Any, max_position: int) -> Any:
        """Grow the position embedding to ``max_position`` by repeating the trained rows.

        Args:
            model: a BERT or RoBERTa model (``model.bert`` / ``model.roberta``).
            max_position: the new number of positions; above the current one.

        Returns:
            ``model``, its ``config.max_position_embeddings`` updated.

        Raises:
            SparsityConfigError: another kind of model, or ``max_position`` not above the current.
        """
        embedding, reserved = _positions(model)
        weight = embedding.weight
        original = weight.size(0) - reserved
        if max_position <= original:
            raise SparsityConfigError(f"max_position {max_position} must be above the current {original} positions")
        multiples = max(1, max_position // original)
        if reserved == 0:
            weight.data = weight.repeat(multiples, 1)
        else:  # RoBERTa: positions 0 and 1 are reserved, the trained rows repeat after them
            extended = weight.new_zeros(max_position + reserved, weight.size(1))  # DeepSpeed: new_empty
            extended[:reserved] = weight[:reserved]
            for i in range(multiples):
                start = reserved + i * original
                extended[start:start + original] = weight[reserved:]
            weight.data = extended
            max_position += reserved
        model.config.max_position_embeddings = max_position
        logger.info(f"Extended position embeddings to {original * multiples}")
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        """Set the tokenizer's maximum length to ``max_position``; returns it.

        Args:
            tokenizer: a Hugging Face tokenizer.
            max_position: the new maximum length.

        Returns:
            ``tokenizer``.
        """
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        logger.info(f"updated tokenizer model max length to {max_position}")
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(model: Any, max_position: int,
                                                                sparsity_config: SparsityConfig | None = None) -> Any:
        """Swap every encoder layer's self-attention of a BERT or RoBERTa model for
        ``BertSparseSelfAttention``.

        Args:
            model: ``model.bert.encoder.layer`` or ``model.roberta.encoder.layer`` are the layers.
            max_position: the model's new maximum position (RoBERTa's config gets it + 2).
            sparsity_config: the layout for every layer.

        Returns:
            ``model``.

        Raises:
            SparsityConfigError: another kind of model.
        """
        if hasattr(model, "bert"):
            model.config.max_position_embeddings = max_position
            layers = model.bert.encoder.layer
        elif hasattr(model, "roberta"):
            model.config.max_position_embeddings = max_position + 2
            layers = model.roberta.encoder.layer
        else:
            raise SparsityConfigError(f"replace_model_self_attention_with_sparse_self_attention {_ONLY}; "
                                      f"use replace_self_attention_layer_with_sparse_self_attention_layer on "
                                      f"{type(model).__name__}'s layers")
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, layers, sparsity_config)
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
            config: Any, layers: Iterable[Any], sparsity_config: SparsityConfig | None = None) -> Iterable[Any]:
        """Swap ``layer.attention.self`` of each layer for ``BertSparseSelfAttention`` (keeping its
        ``query``, ``key`` and ``value`` modules).

        Args:
            config: the model config (``hidden_size``, ``num_attention_heads``).
            layers: the encoder layers.
            sparsity_config: the layout (None: ``SparsityConfig(num_heads=4)``, which has none:
                DeepSpeed's default, refused).

        Returns:
            ``layers``.

        Raises:
            SparsityConfigError: no usable layout.
        """
        layout = SparsityConfig(num_heads=4) if sparsity_config is None else sparsity_config
        for layer in layers:
            old = layer.attention.self
            sparse = BertSparseSelfAttention(config, layout)
            sparse.query, sparse.key, sparse.value = old.query, old.key, old.value
            layer.attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(block_size: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                          token_type_ids: torch.Tensor, position_ids: torch.Tensor | None,
                          inputs_embeds: torch.Tensor | None, pad_token_id: int,
                          model_embeddings: Any) -> tuple[int, Any, Any, Any, Any, Any]:
        """Pad the inputs along the sequence to a multiple of ``block_size``.

        Args:
            block_size: the layout's block size.
            input_ids: ``[batch, seq]`` token ids, or None when ``inputs_embeds`` is given.
            attention_mask: ``[batch, seq]``; padding gets 0 (not attended).
            token_type_ids: ``[batch, seq]``; padding gets 0.
            position_ids: ``[batch, seq]`` or None; padding gets ``pad_token_id``.
            inputs_embeds: ``[batch, seq, hidden]`` or None; padding gets the embedding of
                ``pad_token_id`` from ``model_embeddings``.
            pad_token_id: the padding token.
            model_embeddings: the model's embedding module (used with ``inputs_embeds`` only).

        Returns:
            ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)``.
        """
        batch, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len > 0:
            if inputs_embeds is not None:
                pad_ids = inputs_embeds.new_full((batch, pad_len), pad_token_id, dtype=torch.long)
                inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
            if input_ids is not None:
                input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
            if position_ids is not None:
                position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
            attention_mask = F.pad(attention_mask, (0, pad_len), value=False)
            token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """The encoder output without the ``pad_len`` positions ``pad_to_block_size`` added.

        Args:
            pad_len: what ``pad_to_block_size`` returned.
            sequence_output: ``[batch, seq, hidden]``.

        Returns:
            ``[batch, seq - pad_len, hidden]``.
        """
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
