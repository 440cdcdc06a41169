"""``DeepSpeedTransformerLayer``: DeepSpeed's fused BERT training layer
(``deepspeed.ops.transformer.DeepSpeedTransformerLayer``) in torch, built on this package's ops.

DeepSpeed's parameters (names, shapes, the q/k/v rows stacked in ``attn_qkvw``), its forward
signature and outputs, and the computation of its CUDA kernel (``ds_transformer_cuda.cpp``):

- Pre-LN: ``h = x + drop(Attn(LN(x; norm_w, norm_b)) @ attn_ow.T + attn_ob)``, then
  ``out = h + drop(FF(LN(h; attn_nw, attn_nb)))``; no final LayerNorm.
- Post-LN (BERT): ``h = LN(x + drop(Attn(x) @ attn_ow.T + attn_ob); attn_nw, attn_nb)``, then
  ``out = LN(h + drop(FF(h)); norm_w, norm_b)``.
- ``Attn``: softmax(q k^T / sqrt(head_size) + mask) with dropout on the probabilities;
  ``FF(h) = gelu_tanh(h @ inter_w.T + inter_b) @ output_w.T + output_b`` (DeepSpeed's kernel uses
  the tanh GeLU; the bias and GeLU are the ``bias_gelu`` op, the norms the ``layer_norm`` op).

The attention mask is added to the scores, as DeepSpeed's (``[batch, 1, 1, seq]`` with 0 to keep
and a large negative number to drop, what Hugging Face's BERT builds); any shape that broadcasts
to ``[batch, heads, seq, seq]`` works, a boolean mask keeps the ``True`` positions, and ``None``
attends everywhere. Softmax and LayerNorm statistics run in fp32 for fp16/bf16 parameters.

Differences from DeepSpeed: any sequence length and batch size (no padding to a multiple of 16, no
``batch_size`` limit), backward in eval mode works, ``adjust_init_range`` applies on every rank
(DeepSpeed applies it only where ``local_rank == 0``, so ranks drew different stds), arguments
the layer cannot honour (a head mask, cross-attention inputs, a key/value cache) raise instead of
being ignored, extra keyword arguments of newer Hugging Face encoders (``past_key_values``, ...)
are accepted when empty, and the ``grads`` test hook does not leave hooks on the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dslaunch.errors import UsageError
from dslaunch.kernels.bias_gelu import bias_gelu
from dslaunch.kernels.normalization import invertible_layer_norm, layer_norm
from dslaunch.kernels.transformer_config import DeepSpeedTransformerConfig, require_layer_settings

__all__ = ["DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig", "additive_mask"]

# (parameter, name in DeepSpeed's ``grads`` test hook); for attn_qkvw/attn_qkvb only the V rows
_GRAD_NAMES = (("attn_ow", "O_W"), ("attn_ob", "O_B"), ("attn_nw", "N2_W"), ("attn_nb", "N2_B"),
               ("inter_w", "int_W"), ("inter_b", "int_B"), ("output_w", "out_W"), ("output_b", "out_B"),
               ("norm_w", "norm_W"), ("norm_b", "norm_B"))
_UNSUPPORTED = ("head_mask", "layer_head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_value",
                "past_key_values")


def additive_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``mask`` as fp32 numbers to add to the attention scores: a boolean mask becomes 0 where
    True and the lowest fp32 where False; a float mask is taken as already additive."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask.float()


def _attention_probs_times_v(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                             p: float, training: bool) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores + mask
    probs = F.dropout(torch.softmax(scores, dim=-1).to(v.dtype), p, training)
    return torch.matmul(probs, v)


def _gelu_then_out(h: torch.Tensor, inter_b: torch.Tensor, output_w: torch.Tensor) -> torch.Tensor:
    return F.linear(bias_gelu(h, inter_b, "tanh"), output_w)


class DeepSpeedTransformerLayer(nn.Module):
    """DeepSpeed's fused transformer layer (see the module docstring for what it computes).

    Class attribute ``layer_id`` counts the layers built so far (DeepSpeed's static counter);
    an instance's ``layer_id`` is its index in that count.

    Args:
        config: a ``DeepSpeedTransformerConfig`` with hidden_size, heads and both dropout ratios
            given (and initializer_range, num_hidden_layers when the layer draws its weights).
        initial_weights: DeepSpeed's test hook: eight tensors ``[q_w, k_w, v_w, attn_ow, attn_nw,
            inter_w, output_w, norm_w]``; q/k/v are stacked into ``attn_qkvw`` (``attn_qkvb`` is
            zero) and the others are used as given (shared, as in DeepSpeed).
        initial_biases: eight tensors, of which ``[3:8]`` are ``attn_ob, attn_nb, inter_b,
            output_b, norm_b``.

    Raises:
        ConfigError: a setting the layer needs is missing.
        UsageError: only one of ``initial_weights``/``initial_biases`` given, or a wrong count.
    """

    layer_id = 0

    def __init__(self, config: DeepSpeedTransformerConfig, initial_weights: list[torch.Tensor] | None = None,
                 initial_biases: list[torch.Tensor] | None = None):
        super().__init__()
        initializing = initial_weights is None and initial_biases is None
        require_layer_settings(config, initializing)
        self.config = config
        self.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        if config.local_rank >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(config.local_rank)
        if initializing:
            self._new_parameters()
            self.init_transformer_weights(config.adjust_init_range)
        else:
            self._given_parameters(initial_weights, initial_biases)
        self.train(config.training)

    def _new_parameters(self) -> None:
        hidden, inter = self.config.hidden_size, self.config.intermediate_size
        device = torch.device("cuda", torch.cuda.current_device()) if self.config.local_rank >= 0 and \
            torch.cuda.is_available() else None
        for name, shape in (("attn_qkvw", (3 * hidden, hidden)), ("attn_qkvb", (3 * hidden,)),
                            ("attn_ow", (hidden, hidden)), ("attn_ob", (hidden,)), ("attn_nw", (hidden,)),
                            ("attn_nb", (hidden,)), ("inter_w", (inter, hidden)), ("inter_b", (inter,)),
                            ("output_w", (hidden, inter)), ("output_b", (hidden,)), ("norm_w", (hidden,)),
                            ("norm_b", (hidden,))):
            setattr(self, name, nn.Parameter(torch.empty(shape, device=device)))

    def _given_parameters(self, weights: list[torch.Tensor] | None, biases: list[torch.Tensor] | None) -> None:
        if weights is None or biases is None or len(weights) != 8 or len(biases) != 8:
            raise UsageError("DeepSpeedTransformerLayer: initial_weights and initial_biases go together, eight "
                             "tensors each ([q, k, v, attn_o, attn_norm, inter, output, norm])")

        def param(t: torch.Tensor) -> nn.Parameter:
            return t if isinstance(t, nn.Parameter) else nn.Parameter(t)

        self.attn_qkvw = nn.Parameter(torch.cat([w.data for w in weights[:3]]))
        self.attn_qkvb = nn.Parameter(torch.zeros(self.attn_qkvw.shape[0], dtype=self.attn_qkvw.dtype,
                                                  device=self.attn_qkvw.device))
        for i, (w_name, b_name) in enumerate((("attn_ow", "attn_ob"), ("attn_nw", "attn_nb"), ("inter_w", "inter_b"),
                                              ("output_w", "output_b"), ("norm_w", "norm_b")), start=3):
            setattr(self, w_name, param(weights[i]))
            setattr(self, b_name, param(biases[i]))

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """DeepSpeed's initialization: normal(0, initializer_range) matrices, zero biases, unit
        LayerNorm weights; with ``adjust_init_range`` the two output projections (``attn_ow``,
        ``output_w``) get std ``initializer_range / sqrt(2 * num_hidden_layers)``."""
        std = self.config.initializer_range
        output_std = std / math.sqrt(2.0 * self.config.num_hidden_layers) if adjust_init_range else std
        with torch.no_grad():
            for name in ("attn_qkvw", "inter_w"):
                getattr(self, name).normal_(mean=0.0, std=std)
            for name in ("attn_ow", "output_w"):
                getattr(self, name).normal_(mean=0.0, std=output_std)
            for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
                getattr(self, name).zero_()
            self.attn_nw.fill_(1.0)
            self.norm_w.fill_(1.0)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: Any = None, layer_head_mask: Any = None, encoder_hidden_states: Any = None,
                encoder_attention_mask: Any = None, past_key_value: Any = None, output_attentions: bool = False,
                grads: list | None = None, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor]:
        """The layer's output for ``hidden_states`` ``[batch, seq, hidden]``.

        Args:
            attention_mask: added to the attention scores (see the module docstring); None: none.
            head_mask ... past_key_value: Hugging Face's layer arguments; must be None (the fused
                layer has no head mask, cross-attention or cache). ``output_attentions`` is ignored,
                as in DeepSpeed.
            grads: DeepSpeed's test hook: a list that backward appends ``[gradient, name]`` to (the
                V rows of attn_qkvw/attn_qkvb as "V_W"/"V_B", then "O_W", "O_B", "N2_W", ...).

        Returns:
            The output, same shape and dtype; ``(output,)`` with ``config.return_tuple``.

        Raises:
            UsageError: a head mask, cross-attention input or cache was given.
        """
        given = {"head_mask": head_mask, "layer_head_mask": layer_head_mask,
                 "encoder_hidden_states": encoder_hidden_states, "encoder_attention_mask": encoder_attention_mask,
                 "past_key_value": past_key_value, **kwargs}
        for name in _UNSUPPORTED:
            if given.get(name) is not None:
                raise UsageError(f"DeepSpeedTransformerLayer.forward: {name} is not supported by the fused layer "
                                 "(self-attention only, no head mask or cache); pass None")
        params = {name: p for name, p in self.named_parameters(recurse=False)}
        if grads is not None:
            params = self._hooked(params, grads)
        out = self._layer(hidden_states, additive_mask(attention_mask), params)
        return (out,) if self.config.return_tuple else out

    def _hooked(self, params: dict[str, torch.Tensor], grads: list) -> dict[str, torch.Tensor]:
        """Views of the parameters that report their gradients to ``grads`` (only for this graph)."""
        hidden = self.config.hidden_size
        views = {name: p.view_as(p) for name, p in params.items()}
        for name, label in (("attn_qkvw", "V_W"), ("attn_qkvb", "V_B")):
            views[name].register_hook(lambda g, label=label: grads.append([g[2 * hidden:3 * hidden], label]))
        for name, label in _GRAD_NAMES:
            views[name].register_hook(lambda g, label=label: grads.append([g, label]))
        return views

    def _norm(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        eps = self.config.layer_norm_eps
        if self.config.normalize_invertible:
            return lambda x, w, b: invertible_layer_norm(x, w, b, eps)
        return lambda x, w, b: layer_norm(x, w, b, eps)

    def _layer(self, x: torch.Tensor, mask: torch.Tensor | None, p: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg, norm = self.config, self._norm()
        drop = cfg.hidden_dropout_ratio if self.training else 0.0
        if cfg.pre_layer_norm:
            h = x + F.dropout(F.linear(self._attention(norm(x, p["norm_w"], p["norm_b"]), mask, p), p["attn_ow"],
                                       p["attn_ob"]), drop)
            return h + F.dropout(self._feed_forward(norm(h, p["attn_nw"], p["attn_nb"]), p), drop)
        h = x + F.dropout(F.linear(self._attention(x, mask, p), p["attn_ow"], p["attn_ob"]), drop)
        h = norm(h, p["attn_nw"], p["attn_nb"])
        return norm(h + F.dropout(self._feed_forward(h, p), drop), p["norm_w"], p["norm_b"])

    def _attention(self, x: torch.Tensor, mask: torch.Tensor | None, p: dict[str, torch.Tensor]) -> torch.Tensor:
        batch, seq, hidden = x.shape
        heads = self.config.heads
        qkv = F.linear(x, p["attn_qkvw"], p["attn_qkvb"]).view(batch, seq, 3, heads, hidden // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        drop = self.config.attn_dropout_ratio if self.training else 0.0
        if self.config.attn_dropout_checkpoint and torch.is_grad_enabled():
            # the probabilities (and their dropout, same RNG state) are recomputed in backward
            ctx = checkpoint(_attention_probs_times_v, q, k, v, mask, drop, self.training, use_reentrant=False)
        else:
            ctx = _attention_probs_times_v(q, k, v, mask, drop, self.training)
        return ctx.transpose(1, 2).reshape(batch, seq, hidden)

    def _feed_forward(self, h: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        inter = F.linear(h, p["inter_w"])
        if self.config.gelu_checkpoint and torch.is_grad_enabled():
            # the GeLU output (intermediate_size wide) is recomputed in backward, not kept
            out = checkpoint(_gelu_then_out, inter, p["inter_b"], p["output_w"], use_reentrant=False)
        else:
            out = _gelu_then_out(inter, p["inter_b"], p["output_w"])
        return out + p["output_b"]
