"""``deepspeed.runtime.data_pipeline.data_routing.basic_layer``: ``RandomLayerTokenDrop``, a
transformer layer that, in training, processes only a random subset of the sequence's tokens (the
others pass it unchanged), as DeepSpeed's random-LTD.

``convert_to_random_ltd`` wraps the layers; the engine (``random_ltd_initialize``) then numbers the
ones ``random_ltd_layer_id`` names and hands them the config and the scheduler. The first dropping
layer draws the kept tokens of every dropping layer for the micro batch (``gpt_sample_tokens`` for
a ``decoder``, ``bert_sample_tokens`` for an ``encoder``), the others read them from the scheduler's
state; each gathers its kept tokens, runs the layer on them (with the attention mask cut to them,
``model_mask_name``) and scatters the outputs back. Evaluation, and a kept length at or above the
sequence's, run the layer on everything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from dslaunch.errors import ConfigError, UsageError
from dslaunch.runtime.data_pipeline.data_routing.tokens import (
    GatherTokens,
    ScatterTokens,
    bert_sample_tokens,
    gpt_sample_tokens,
)

__all__ = ["RandomLayerTokenDrop", "gpt_sample_tokens", "bert_sample_tokens", "GatherTokens", "ScatterTokens"]


class RandomLayerTokenDrop(Module):
    """A wrapped layer (``random_ltd_layer``); plain until ``init_config``."""

    def __init__(self, layer: Module):
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: Any = None
        self.max_length: int | None = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.batch_first = False

    def init_config(self, config: Mapping[str, Any], scheduler: Any, random_ltd_layer_id: int) -> None:
        """Join the schedule as dropping layer number ``random_ltd_layer_id`` (0 draws the tokens).

        Raises:
            ConfigError: ``hidden_state_order`` or ``model_type`` not one DeepSpeed has.
        """
        order, kind = config.get("hidden_state_order"), config.get("model_type")
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ConfigError(f"must be batch_seq_dim or seq_batch_dim, got {order!r}",
                              key="data_efficiency.data_routing.random_ltd.hidden_state_order")
        if kind not in ("encoder", "decoder"):
            raise ConfigError(f"must be encoder or decoder, got {kind!r}",
                              key="data_efficiency.data_routing.random_ltd.model_type")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state["max_value"]
        self.mask_name = config.get("model_mask_name")
        self.micro_bs = config.get("micro_batch_size")
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.batch_first = order == "batch_seq_dim"
        self.model_type = kind
        self.index_generator = bert_sample_tokens if kind == "encoder" else gpt_sample_tokens

    def _shape(self, hidden: Tensor) -> None:
        seq, batch = (hidden.size(1), hidden.size(0)) if self.batch_first else (hidden.size(0), hidden.size(1))
        self.curr_seq, self.curr_micro_batch = seq, batch

    def forward(self, hidden_states: Tensor, **kwargs: Any) -> Any:
        """The layer on the kept tokens (training), or on all of them.

        Raises:
            UsageError: the layer returned something other than a tensor or a tuple starting with one.
        """
        if self.random_ltd_scheduler is not None:
            self.reserved_length = self.random_ltd_scheduler.get_current_seq()
            self._shape(hidden_states)
        if not (self.training and self.random_ltd_scheduler is not None and self.reserved_length < self.curr_seq):
            return self.random_ltd_layer(hidden_states, **kwargs)
        state = self.random_ltd_scheduler.state
        mask = kwargs[self.mask_name] if self.mask_name is not None else None
        if self.random_ltd_layer_id == 0:
            state["sample_idx"], state["attention_mask"] = self.index_generator(
                self.reserved_length, self.curr_seq, self.curr_micro_batch, self.random_ltd_num_layer,
                hidden_states.device, mask)
        indices, part_mask = state["sample_idx"], state["attention_mask"]
        hidden_states, part = GatherTokens.apply(hidden_states, indices[self.random_ltd_layer_id, :, :],
                                                 self.batch_first)
        if self.mask_name is not None:
            kwargs[self.mask_name] = part_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else part_mask
        outputs = self.random_ltd_layer(part, **kwargs)
        first = outputs[0] if isinstance(outputs, tuple) else outputs
        if not isinstance(first, torch.Tensor):
            raise UsageError(f"RandomLayerTokenDrop: {type(self.random_ltd_layer).__name__} returned "
                             f"{type(outputs).__name__}; random-LTD wraps layers returning a tensor or a tuple "
                             "starting with the hidden states")
        merged = ScatterTokens.apply(hidden_states, first, indices[self.random_ltd_layer_id, :, :], self.batch_first)
        return (merged, *outputs[1:]) if isinstance(outputs, tuple) else merged
