"""Where a BERT-family layer keeps the weights of DeepSpeed's fused transformer layer: DeepSpeed's
``HFBertLayerPolicy`` (``deepspeed.module_inject.replace_policy.HFBertLayerPolicy``).

One table (``parameter_map``) maps each ``DeepSpeedTransformerLayer`` parameter to the client
layer's parameters (q/k/v stacked for ``attn_qkvw``/``attn_qkvb``), so copying in
(``replace_transformer_layer``) and back (``revert_transformer_layer``) read the same facts.
Hugging Face's ``BertLayer``/``RobertaLayer`` are Post-LN (``attention.output.LayerNorm`` ->
``attn_nw``, ``output.LayerNorm`` -> ``norm_w``); a layer with ``PreAttentionLayerNorm`` (the
Pre-LN BERT of DeepSpeed's bing_bert example) is Pre-LN (``PostAttentionLayerNorm`` -> ``attn_nw``,
``PreAttentionLayerNorm`` -> ``norm_w``, ``intermediate.dense_act``), as DeepSpeed's policy reads it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dslaunch.errors import UsageError

__all__ = ["HFBertLayerPolicy", "DEFAULT_INTERMEDIATE_SIZE"]

DEFAULT_INTERMEDIATE_SIZE = -1
"""DeepSpeed's answer for the intermediate size in ``get_hidden_heads`` (read from the weights)."""


def _hf_bert_classes() -> list[type] | None:
    try:
        from transformers.models.bert.modeling_bert import BertLayer
        from transformers.models.roberta.modeling_roberta import RobertaLayer
    except (ImportError, AttributeError):
        return None
    return [BertLayer, RobertaLayer]


def _get(root: nn.Module | None, path: str) -> Any:
    module: Any = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            raise UsageError(f"HFBertLayerPolicy: {type(root).__name__} has no '{path}'; the policy reads "
                             "BERT-family layers (attention.self.query/key/value, attention.output, intermediate, "
                             "output)")
    return module


class HFBertLayerPolicy:
    """The weights of one BERT-family layer under ``DeepSpeedTransformerLayer``'s names.

    ``_orig_layer_class`` is transformers' ``[BertLayer, RobertaLayer]`` (None without
    transformers), filled on the first instance as in DeepSpeed.

    Args:
        client_module: the layer (``None`` only to fill ``_orig_layer_class``).
        inference: accepted for DeepSpeed's signature.

    Raises:
        UsageError: (on use) the module lacks a BERT layer's submodules.
    """

    _orig_layer_class: list[type] | None = None

    def __init__(self, client_module: nn.Module | None, inference: bool = False):
        self.client_module, self.inference = client_module, inference
        self.pre_attn_norm = client_module is not None and hasattr(client_module, "PreAttentionLayerNorm")
        self.cuda_graph_supported = True
        if HFBertLayerPolicy._orig_layer_class is None:
            HFBertLayerPolicy._orig_layer_class = _hf_bert_classes()

    def _paths(self) -> dict[str, list[str]]:
        attn, pre = "attention.self.", self.pre_attn_norm
        attn_norm = "PostAttentionLayerNorm" if pre else "attention.output.LayerNorm"
        norm = "PreAttentionLayerNorm" if pre else "output.LayerNorm"
        inter = "intermediate.dense_act" if pre else "intermediate.dense"
        return {"attn_qkvw": [f"{attn}{n}.weight" for n in ("query", "key", "value")],
                "attn_qkvb": [f"{attn}{n}.bias" for n in ("query", "key", "value")],
                "attn_ow": ["attention.output.dense.weight"], "attn_ob": ["attention.output.dense.bias"],
                "attn_nw": [f"{attn_norm}.weight"], "attn_nb": [f"{attn_norm}.bias"],
                "inter_w": [f"{inter}.weight"], "inter_b": [f"{inter}.bias"],
                "output_w": ["output.dense.weight"], "output_b": ["output.dense.bias"],
                "norm_w": [f"{norm}.weight"], "norm_b": [f"{norm}.bias"]}

    def parameter_map(self) -> dict[str, list[torch.Tensor]]:
        """``DeepSpeedTransformerLayer`` parameter name -> the client's parameters it stacks.

        Raises:
            UsageError: the client lacks one of them.
        """
        return {name: [_get(self.client_module, path) for path in paths] for name, paths in self._paths().items()}

    def get_hidden_heads(self) -> tuple[int, int, float, int]:
        """(hidden size, attention heads, the attention LayerNorm's eps, ``DEFAULT_INTERMEDIATE_SIZE``)."""
        attn_norm = _get(self.client_module, "PostAttentionLayerNorm" if self.pre_attn_norm
                         else "attention.output.LayerNorm")
        query = _get(self.client_module, "attention.self.query.weight")
        heads = getattr(_get(self.client_module, "attention.self"), "num_attention_heads", None)
        if heads is None:  # transformers >= 5 keeps the count in the config
            heads = _get(self.client_module, "attention.self.config").num_attention_heads
        return query.shape[1], heads, attn_norm.eps, DEFAULT_INTERMEDIATE_SIZE

    def attention(self, enable_training: bool = False) -> tuple[torch.Tensor, ...]:
        """(qkv weight, qkv bias) stacked as new parameters, then the output projection's weight and bias."""
        p = self.parameter_map()
        qkvw, qkvb = (nn.Parameter(torch.cat([t.detach() for t in p[n]]), requires_grad=enable_training)
                      for n in ("attn_qkvw", "attn_qkvb"))
        return qkvw, qkvb, p["attn_ow"][0], p["attn_ob"][0]

    def mlp(self, enable_training: bool = False) -> tuple[torch.Tensor, ...]:
        """(intermediate weight, bias, output weight, bias)."""
        p = self.parameter_map()
        return p["inter_w"][0], p["inter_b"][0], p["output_w"][0], p["output_b"][0]

    def layernorm(self) -> tuple[torch.Tensor, ...]:
        """(attention LayerNorm weight, bias, layer LayerNorm weight, bias)."""
        p = self.parameter_map()
        return p["attn_nw"][0], p["attn_nb"][0], p["norm_w"][0], p["norm_b"][0]
