"""``deepspeed.runtime.domino.transformer``: Domino, a Megatron-style tensor-parallel transformer
that hides its all-reduces behind computation.

Each layer's attention and MLP end in a row-parallel linear whose partial sums are all-reduced over
the tensor-parallel group. Domino splits the batch (dimension 1 of ``[s, b, h]``) in two micro
batches and interleaves them: while one micro batch's all-reduce runs, the other computes. In
backward the column-parallel linears start their input gradient's all-reduce and return
(``async_linear.py``); ``wait_backward_comm`` waits where that gradient is next used.

The model is a sequence of phases (attention, MLP, per layer); a phase ``_start``s (compute, then
the all-reduce without waiting) and ``_finish``es (wait, bias, dropout, residual). Two orders:

- intra-layer (``config.domino_intra_layer_overlap``): in each phase, micro batch 1 computes
  while micro batch 0's all-reduce runs;
- inter-layer (the default): additionally, micro batch 1 finishes phase p only after micro batch
  0 has started phase p + 1, so every all-reduce has compute of the other micro batch behind it.

Both give the same numbers as the same model without Domino (the tests compare with an unsplit
one).

Differences from DeepSpeed 0.19.8:
- the backward handles live in each layer (``handles``), not in a class-level dict shared by every
  Domino model in the process; each linear reduces over its own group;
- the attention's dropout applies in training only (DeepSpeed passes ``dropout_p`` to
  ``scaled_dot_product_attention`` in eval too);
- with ``apply_residual_connection_post_layernorm`` the residual branch takes the layernorm output
  before the backward wait, so its gradient is never summed with a still-reducing one;
- only self-attention with a causal mask, as in DeepSpeed, but a padding mask type or
  cross-attention is refused in one line instead of being computed as causal; a batch of one
  (nothing to split) likewise.
- ``gated_linear_unit``: as in DeepSpeed, the MLP stays a plain GELU one (the flag is not applied).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dslaunch.errors import UsageError
from dslaunch.runtime.domino.async_linear import (
    DominoAsyncColumnParallelLinear,
    RowParallelLinearNoComm,
    config_value,
)

__all__ = ["LayerType", "AttnType", "AttnMaskType", "ModelType", "DominoUtil", "DominoModule", "NoOper",
           "wait_backward_comm", "CoreAttention", "ShardedAttention", "bias_dropout_add", "DominoTransformerLayer",
           "DominoTransformer"]


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2


class DominoUtil:
    """The micro batches' keys in a handle dict (DeepSpeed's names)."""

    BATCH_0 = "BATCH0"
    BATCH_1 = "BATCH1"


def _handles() -> dict[str, Any]:
    return {DominoUtil.BATCH_0: None, DominoUtil.BATCH_1: None}


class DominoModule(torch.nn.Module):
    """Base class of Domino's modules (DeepSpeed's)."""


class NoOper(torch.autograd.Function):
    """Identity forward; backward waits on ``handle_dic[h_id]`` (the input gradient's all-reduce a
    ``DominoAsyncColumnParallelLinear`` started) before handing the gradient on."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, handle_dic: MutableMapping[str, Any], h_id: str) -> torch.Tensor:
        ctx.handle_dic, ctx.h_id = handle_dic, h_id
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        handle = ctx.handle_dic.get(ctx.h_id)
        if handle is not None:
            handle.wait()
            ctx.handle_dic[ctx.h_id] = None
        return grad_output, None, None


def wait_backward_comm(input_: torch.Tensor, handle_dic: MutableMapping[str, Any], h_id: str) -> torch.Tensor:
    """``input_``, whose gradient waits for micro batch ``h_id``'s all-reduce (DeepSpeed's
    ``_Wait_bwd_comm``). Apply it to exactly what a column-parallel linear takes."""
    return NoOper.apply(input_, handle_dic, h_id)


_Wait_bwd_comm = wait_backward_comm  # DeepSpeed's private name, which Domino scripts import


def _tp(mpu: Any) -> tuple[int, Any]:
    return mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_group()


def _per_partition(total: int, tp_world_size: int, what: str) -> int:
    if total % tp_world_size:
        raise UsageError(f"Domino: {what} ({total}) must be a multiple of the tensor-parallel size ({tp_world_size})")
    return total // tp_world_size


class CoreAttention(DominoModule):
    """Causal scaled-dot-product attention of this rank's heads: ``[b, np, s, hn]`` in,
    ``[s, b, np * hn]`` out."""

    def __init__(self, config: Any, tp_world_size: int, attn_mask_type: AttnMaskType = AttnMaskType.causal):
        super().__init__()
        if attn_mask_type != AttnMaskType.causal:
            raise UsageError(f"Domino: attn_mask_type {attn_mask_type} is not supported; Domino's attention is "
                             "causal (AttnMaskType.causal)")
        self.attn_mask_type = attn_mask_type
        projection = config_value(config, "kv_channels") * config_value(config, "num_attention_heads")
        self.hidden_size_per_partition = _per_partition(projection, tp_world_size, "kv_channels x num_attention_heads")
        self.attention_dropout_rate = config_value(config, "attention_dropout")

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask: Any = None) -> torch.Tensor:
        """The mask is implied (causal); ``attention_mask`` is accepted as DeepSpeed's is."""
        dropout = self.attention_dropout_rate if self.training else 0.0
        context = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, dropout_p=dropout,
                                                 is_causal=True)
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:-2], self.hidden_size_per_partition)


class ShardedAttention(DominoModule):
    """Self-attention over this rank's heads: column-parallel QKV (per head ``[q, k, v]``), causal
    attention, row-parallel output projection whose all-reduce is the caller's.

    Args:
        config: Megatron's TransformerConfig.
        mpu: ``get_tensor_model_parallel_world_size()``, ``get_tensor_model_parallel_group()``.
        apply_rotary_pos_emb: ``(t, freqs) -> t`` for queries and keys (``[b, np, s, hn]``).
        layer_number: 1-based.
    """

    def __init__(self, config: Any, mpu: Any, apply_rotary_pos_emb: Callable | None, layer_number: int,
                 attention_type: AttnType = AttnType.self_attn, attn_mask_type: AttnMaskType = AttnMaskType.causal):
        super().__init__()
        if attention_type != AttnType.self_attn:
            raise UsageError(f"Domino: attention_type {attention_type} is not supported; only AttnType.self_attn")
        self.layer_number, self.attention_type, self.attn_mask_type = max(1, layer_number), attention_type, attn_mask_type
        self.params_dtype = config_value(config, "params_dtype")
        self.apply_rotary_pos_emb = apply_rotary_pos_emb
        tp_world_size, group = _tp(mpu)
        heads, head_dim = config_value(config, "num_attention_heads"), config_value(config, "kv_channels")
        self.hidden_size_per_attention_head = head_dim
        self.num_attention_heads_per_partition = _per_partition(heads, tp_world_size, "num_attention_heads")
        projection = heads * head_dim
        bias = config_value(config, "add_bias_linear")
        self.query_key_value = DominoAsyncColumnParallelLinear(
            config_value(config, "hidden_size"), 3 * projection // tp_world_size, group, config=config,
            init_method=config_value(config, "init_method"), bias=bias)
        self.core_attention = CoreAttention(config, tp_world_size, attn_mask_type)
        self.dense = RowParallelLinearNoComm(projection // tp_world_size, config_value(config, "hidden_size"),
                                             config=config, init_method=config_value(config, "output_layer_init_method"),
                                             bias=bias, skip_bias_add=True)
        self.handles = _handles()

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, micro_batch_num: str,
                rotary_pos_emb: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s, b, h]`` -> (this rank's partial output ``[s, b, h]``, the output bias)."""
        mixed, _ = self.query_key_value(hidden_states, self.handles, micro_batch_num)
        return self.dense(self.domino_core_attention_forward(mixed, attention_mask, rotary_pos_emb))

    def domino_core_attention_forward(self, mixed_x_layer: torch.Tensor, attention_mask: Any,
                                      rotary_pos_emb: Any = None) -> torch.Tensor:
        """The attention between the QKV projection (``[s, b, 3 * np * hn]``) and the output one."""
        heads, head_dim = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed = mixed_x_layer.view(*mixed_x_layer.shape[:-1], heads, 3 * head_dim).permute(1, 2, 0, 3).contiguous()
        query, key, value = torch.split(mixed, [head_dim] * 3, dim=3)
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query, key = self.apply_rotary_pos_emb(query, q_freqs), self.apply_rotary_pos_emb(key, k_freqs)
        return self.core_attention(query, key, value, attention_mask)


class bias_dropout_add(torch.nn.Module):  # noqa: N801 (DeepSpeed's name)
    """``residual + dropout(x + bias)``."""

    def __init__(self, prob: float):
        super().__init__()
        self.dropout = torch.nn.Dropout(prob)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        return self.dropout(x if bias is None else x + bias) + residual


@dataclass
class _Pending:
    """A phase of one micro batch whose output is being all-reduced."""

    out: torch.Tensor
    bias: torch.Tensor | None
    residual: torch.Tensor
    handle: Any
    finish: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        return self.finish(self.out, self.bias, self.residual)


def _all_reduce_async(t: torch.Tensor, group: Any) -> Any:
    import torch.distributed as dist

    return dist.all_reduce(t, group=group, async_op=True)


class DominoTransformerLayer(DominoModule):
    """One pre-LN transformer layer on two micro batches: ``(h0, h1)`` -> ``(h0, h1)``, each
    ``[s, b/2, h]``. Arguments as ``ShardedAttention``'s; ``drop_path_rate`` is accepted (unused,
    as in DeepSpeed)."""

    def __init__(self, config: Any, mpu: Any, apply_rotary_pos_emb: Callable | None, layer_number: int,
                 layer_type: LayerType = LayerType.encoder, self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 drop_path_rate: float = 0.0):
        super().__init__()
        self.layer_number, self.layer_type = layer_number, layer_type
        self.apply_residual_connection_post_layernorm = config_value(config, "apply_residual_connection_post_layernorm")
        self.llama_model = False
        hidden, eps = config_value(config, "hidden_size"), config_value(config, "layernorm_epsilon")
        self.input_layernorm = torch.nn.LayerNorm(hidden, eps=eps)
        self.self_attention = ShardedAttention(config, mpu, apply_rotary_pos_emb, layer_number,
                                               attn_mask_type=self_attn_mask_type)
        self.hidden_dropout = config_value(config, "hidden_dropout")
        self.post_attention_layernorm = torch.nn.LayerNorm(hidden, eps=eps)
        tp_world_size, self.TP_group = _tp(mpu)
        ffn = config_value(config, "ffn_hidden_size")
        per_partition = _per_partition(ffn, tp_world_size, "ffn_hidden_size")
        self.output_size_c, self.input_size_c, self.input_size_r, self.output_size_r = ffn, hidden, ffn, hidden
        self.output_size_per_partition = self.input_size_per_partition = per_partition
        bias = config_value(config, "add_bias_linear")
        self.linear_fc1 = DominoAsyncColumnParallelLinear(hidden, per_partition, self.TP_group, config=config,
                                                          init_method=config_value(config, "init_method"), bias=bias)
        self.mlp_activation_func = F.gelu
        self.linear_fc2 = RowParallelLinearNoComm(per_partition, hidden, config=config,
                                                  init_method=config_value(config, "output_layer_init_method"),
                                                  bias=bias, skip_bias_add=True)
        self.bias_dropout_add_func = bias_dropout_add(self.hidden_dropout)
        self.handles = self.self_attention.handles  # one per layer: its backward waits on its own handles

    def _start_attention(self, hidden: torch.Tensor, key: str, mask: Any, rotary: Any) -> _Pending:
        normed = self.input_layernorm(hidden)
        out, bias = self.self_attention(wait_backward_comm(normed, self.handles, key), mask, key, rotary)
        residual = normed if self.apply_residual_connection_post_layernorm else hidden
        return _Pending(out, bias, residual, _all_reduce_async(out, self.TP_group), self.bias_dropout_add_func)

    def _start_mlp(self, hidden: torch.Tensor, key: str, mask: Any, rotary: Any) -> _Pending:
        normed = self.post_attention_layernorm(hidden)
        up, _ = self.linear_fc1(wait_backward_comm(normed, self.handles, key), self.handles, key)
        out, bias = self.linear_fc2(self.mlp_activation_func(up))
        residual = normed if self.apply_residual_connection_post_layernorm else hidden
        return _Pending(out, bias, residual, _all_reduce_async(out, self.TP_group), self.bias_dropout_add_func)

    def phases(self) -> list[Callable[[torch.Tensor, str, Any, Any], _Pending]]:
        return [self._start_attention, self._start_mlp]

    def forward(self, hidden_states: tuple[torch.Tensor, torch.Tensor], attention_mask: Any,
                rotary_pos_emb: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _run_intra(self.phases(), hidden_states, attention_mask, rotary_pos_emb)


_Phase = Callable[[torch.Tensor, str, Any, Any], _Pending]


def _run_intra(phases: list[_Phase], hidden: tuple[torch.Tensor, torch.Tensor], mask: Any,
               rotary: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each phase: micro batch 1 computes while micro batch 0's all-reduce runs."""
    h0, h1 = hidden
    for start in phases:
        p0 = start(h0, DominoUtil.BATCH_0, mask, rotary)
        p1 = start(h1, DominoUtil.BATCH_1, mask, rotary)
        h0, h1 = p0.wait(), p1.wait()
    return h0, h1


def _run_inter(phases: list[_Phase], hidden: tuple[torch.Tensor, torch.Tensor], mask: Any,
               rotary: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro batch 1 finishes phase p after micro batch 0 started phase p + 1: every all-reduce of
    either has the other's compute behind it."""
    h0, h1 = hidden
    pending1 = None
    for start in phases:
        p0 = start(h0, DominoUtil.BATCH_0, mask, rotary)
        if pending1 is not None:
            h1 = pending1.wait()
        pending1 = start(h1, DominoUtil.BATCH_1, mask, rotary)
        h0 = p0.wait()
    return h0, pending1.wait() if pending1 is not None else h1


class DominoTransformer(DominoModule):
    """``config.num_layers`` Domino layers and a final LayerNorm: ``[s, b, h]`` -> ``[s, b, h]``,
    the batch split in two micro batches inside.

    Args:
        config: Megatron's TransformerConfig (also ``num_layers``, ``domino_intra_layer_overlap``).
        mpu: the tensor-parallel groups (``get_tensor_model_parallel_world_size``/``_group``).
        apply_rotary_pos_emb: applied to queries and keys when a forward gets ``rotary_pos_emb``.
        model_type: accepted as DeepSpeed's (``ModelType``).
        post_layer_norm, post_process: the final LayerNorm (both needed).
        pre_process, drop_path_rate, layer_type, self_attn_mask_type: as DeepSpeed's.

    collective: forward and backward all-reduce over the tensor-parallel group: call on all its ranks.
    """

    def __init__(self, config: Any, mpu: Any, apply_rotary_pos_emb: Callable | None, model_type: Any,
                 layer_type: LayerType = LayerType.encoder, self_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 post_layer_norm: bool = True, pre_process: bool = True, post_process: bool = True,
                 drop_path_rate: float = 0.0):
        super().__init__()
        import torch.distributed as dist

        if not dist.is_initialized():
            from dslaunch.runtime.dist import init_distributed

            init_distributed()
        self.layer_type, self.model_type = layer_type, model_type
        self.post_layer_norm, self.post_process, self.input_tensor = post_layer_norm, post_process, None
        self.drop_path_rate, self.TP_group = drop_path_rate, _tp(mpu)[1]
        self.num_layers = config_value(config, "num_layers")
        self.drop_path_rates = [r.item() for r in torch.linspace(0, drop_path_rate, self.num_layers)]
        self.layers = torch.nn.ModuleList(
            DominoTransformerLayer(config, mpu, apply_rotary_pos_emb, i + 1, layer_type=layer_type,
                                   self_attn_mask_type=self_attn_mask_type, drop_path_rate=self.drop_path_rates[i])
            for i in range(self.num_layers))
        if post_process and post_layer_norm:
            self.final_layernorm = torch.nn.LayerNorm(config_value(config, "hidden_size"),
                                                      eps=config_value(config, "layernorm_epsilon"))
        self.intra_layer = bool(getattr(config, "domino_intra_layer_overlap", False))

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, rotary_pos_emb: Any = None) -> torch.Tensor:
        """``[s, b, h]`` (b at least 2) -> ``[s, b, h]``, in the order the config names."""
        return self._forward(self.intra_layer, hidden_states, attention_mask, rotary_pos_emb)

    def inter_layer_overlap_forward(self, hidden_states: torch.Tensor, attention_mask: Any,
                                    rotary_pos_emb: Any = None) -> torch.Tensor:
        """``forward`` in the inter-layer order, whatever the config says."""
        return self._forward(False, hidden_states, attention_mask, rotary_pos_emb)

    def intra_layer_overlap_forward(self, hidden_states: torch.Tensor, attention_mask: Any,
                                    rotary_pos_emb: Any = None) -> torch.Tensor:
        """``forward`` in the intra-layer order, whatever the config says."""
        return self._forward(True, hidden_states, attention_mask, rotary_pos_emb)

    def _forward(self, intra: bool, hidden_states: torch.Tensor, attention_mask: Any, rotary_pos_emb: Any) -> torch.Tensor:
        if hidden_states.shape[1] < 2:
            raise UsageError(f"Domino splits the batch (dimension 1 of [s, b, h]) in two micro batches: "
                             f"got b = {hidden_states.shape[1]}; use a micro batch size of at least 2")
        phases = [start for layer in self.layers for start in layer.phases()]
        halves = (_run_intra if intra else _run_inter)(phases, tuple(torch.chunk(hidden_states, 2, dim=1)),
                                                       attention_mask, rotary_pos_emb)
        if self.post_process and self.post_layer_norm:
            halves = tuple(self.final_layernorm(h) for h in halves)
        return torch.cat(halves, dim=1)
