"""What the estimator needs to know about a model: ``ModelShape``, and three ways to get one.

- ``ModelShape.from_counts(params, largest_layer, ...)``: numbers the user knows.
- ``from_hf_config(path)``: a Hugging Face ``config.json`` of a decoder (GPT-2, Llama, Mistral,
  Qwen, ... style): parameters counted from the architecture's formula, torch-free.
- ``from_module(model)`` / ``from_builder("pkg.mod:build")``: a real ``nn.Module`` (built on the
  meta device by ``from_builder``, so a 70B model costs no memory): every parameter counted, shared
  ones once, and the largest module's own parameters (what ZeRO-3 gathers at once).

Torch is imported only by the last two.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from dslaunch.errors import UsageError, shorten
from dslaunch.textfile import read_json

__all__ = ["ModelShape", "from_hf_config", "from_module", "from_builder", "HF_CONFIG_MAX_BYTES"]

HF_CONFIG_MAX_BYTES = 16 * 2**20
"""A config.json is a few KiB; the largest seen on the Hub are under 1 MiB."""


@dataclass(frozen=True)
class ModelShape:
    """A model's size as far as memory goes. Only ``params`` is required.

    Attributes:
        params: trainable parameters (a tied/shared tensor counted once).
        largest_layer: the most parameters one module holds itself (not its children): ZeRO-3
            gathers a module's parameters whole, so this much is whole on a device at least.
        param_sizes: elements of every parameter tensor, when known (stage 3 keeps tensors of at
            most ``stage3_param_persistence_threshold`` elements whole on every rank); empty: unknown,
            taken as none small.
        buffer_bytes: bytes of registered buffers (not trained, held whole by every rank).
        hidden, layers, heads, vocab, ffn: the transformer's dimensions, for activations (unknown:
            None; then activations are not estimated). ``ffn`` defaults to 4 * hidden.
        attention: the layers have self-attention; False: residual MLP blocks only (a norm, the
            FFN's two matrices and a dropout: the transformer layer's MLP half).
        expert_params: the part of ``params`` in the experts of mixture-of-experts layers (all
            experts counted): spread over the expert-parallel ranks (``TrainingSetup.expert_parallel``).
        num_experts: experts per MoE layer, when known (the expert-parallel size must divide it).
        name: what the shape was read from, for tables.
    """

    params: int
    largest_layer: int = 0
    param_sizes: tuple[int, ...] = field(default=(), repr=False)
    buffer_bytes: int = 0
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    vocab: int | None = None
    ffn: int | None = None
    attention: bool = True
    expert_params: int = 0
    num_experts: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise UsageError(f"model: params must be a positive count, got {self.params}")
        if not 0 <= self.largest_layer <= self.params:
            raise UsageError(f"model: largest_layer must be in [0, params={self.params}], got {self.largest_layer}")
        if not 0 <= self.expert_params <= self.params:
            raise UsageError(f"model: expert_params must be in [0, params={self.params}], got {self.expert_params}")
        for name in ("hidden", "layers", "heads", "vocab", "ffn", "num_experts"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"model: {name} must be a positive integer, got {value}")

    @classmethod
    def from_counts(cls, params: int, largest_layer: int = 0, **dims: Any) -> ModelShape:
        """A shape from counts the user knows (``dims``: hidden, layers, heads, vocab, ffn,
        expert_params, num_experts, name)."""
        return cls(params=int(params), largest_layer=int(largest_layer), **dims)

    @property
    def transformer(self) -> bool:
        """Whether the dimensions activations need are known."""
        return self.hidden is not None and self.layers is not None

    def small_params(self, threshold: int) -> int:
        """Elements in parameter tensors of at most ``threshold`` elements (0 when sizes are unknown)."""
        return sum(n for n in self.param_sizes if n <= threshold)

    def with_dims(self, **dims: Any) -> ModelShape:
        """A copy with the given dimensions set (None values are ignored)."""
        return replace(self, **{k: v for k, v in dims.items() if v is not None})


# Hugging Face's names for the same dimension, across architectures.
_HF_KEYS = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
}


def _positive(cfg: dict, key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _hf_value(cfg: dict, dim: str) -> int | None:
    return next((v for key in _HF_KEYS[dim] if (v := _positive(cfg, key)) is not None), None)


def from_hf_config(path: str) -> ModelShape:
    """The shape of the decoder a Hugging Face ``config.json`` describes.

    Counted per layer: attention (q and o of hidden x hidden, k and v of hidden x kv heads x head
    dim), the MLP (gated: 3 matrices, as Llama/Mistral/Qwen, when ``hidden_act`` is silu/swiglu;
    else 2 with biases, as GPT-2), two norms; then the embedding, learned positions where the
    config has ``n_positions`` (GPT-2), the final norm and an untied output head. Exact for GPT-2
    and Llama-family checkpoints (GPT-2 small: 124,439,808; Llama-2-7B: 6,738,415,616).

    Mixture of experts (``num_local_experts`` as Mixtral, ``num_experts`` as Qwen-MoE,
    ``n_routed_experts``): an MoE layer's MLP is a router (hidden x experts) and every expert's MLP
    (``moe_intermediate_size`` wide, else ``intermediate_size``), each matrix one tensor over the
    experts (as transformers stores them), plus shared experts where the config has them
    (``shared_expert_intermediate_size`` with its gate, ``n_shared_experts``); the layers that stay
    dense are ``mlp_only_layers``, the first ``first_k_dense_replace`` and those off
    ``decoder_sparse_step``.

    Limitations: encoder-decoder configs are counted as a plain decoder, and so is DeepSeek's
    multi-head latent attention (build such a model with ``from_builder`` instead).

    Raises:
        UsageError: the file cannot be read, is not JSON, or lacks hidden size, layers or vocab.
    """
    def fail(message: str, line: int | None) -> UsageError:
        return UsageError(f"--hf_config {shorten(path, 200)}{f':{line}' if line else ''}: {message}")

    cfg = read_json(path, HF_CONFIG_MAX_BYTES, fail)
    if not isinstance(cfg, dict):
        raise UsageError(f"--hf_config {shorten(path, 200)}: expected a JSON object (a config.json)")
    dims = {d: _hf_value(cfg, d) for d in _HF_KEYS}
    missing = [_HF_KEYS[d][0] for d in ("hidden", "layers", "vocab") if dims[d] is None]
    if missing:
        raise UsageError(f"--hf_config {shorten(path, 200)}: no {', '.join(missing)} (a Hugging Face decoder "
                         "config.json has hidden_size, num_hidden_layers and vocab_size)")
    h, n, v = dims["hidden"], dims["layers"], dims["vocab"]
    heads = dims["heads"] or 1
    ffn = dims["ffn"] or 4 * h
    kv = h // heads * (_positive(cfg, "num_key_value_heads") or heads)
    gated = str(cfg.get("hidden_act", cfg.get("activation_function", ""))).lower() in ("silu", "swiglu", "swish")
    bias = bool(cfg.get("attention_bias", not gated))  # GPT-2 style layers carry biases
    attn = [h * h, h * kv, h * kv, h * h] + ([h, kv, kv, h] if bias else [])
    mlp = _mlp(h, ffn, gated)
    norms = [h, h] if gated else [h, h, h, h]  # RMSNorm weights; LayerNorm weight + bias
    layer = attn + mlp + norms
    positions = [_positive(cfg, "n_positions") * h] if _positive(cfg, "n_positions") else []
    tied = bool(cfg.get("tie_word_embeddings", not gated))
    outer = [v * h, *positions, *([h] if gated else [h, h]), *([] if tied else [v * h])]
    experts = next((e for key in _HF_EXPERT_KEYS if (e := _positive(cfg, key)) is not None), None)
    sparse = _sparse_layers(cfg, n) if experts else 0
    expert_mlp = _mlp(h, _positive(cfg, "moe_intermediate_size") or ffn, gated) if experts else []
    moe_layer = attn + [h * (experts or 0)] + [experts * x for x in expert_mlp] + _shared_experts(cfg, h, gated) + norms
    sizes = tuple(layer * (n - sparse) + moe_layer * sparse + outer)
    return ModelShape(params=sum(sizes), largest_layer=max(sizes),
                      param_sizes=sizes, hidden=h, layers=n, heads=heads, vocab=v, ffn=ffn,
                      expert_params=sum(expert_mlp) * (experts or 0) * sparse, num_experts=experts,
                      name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path)


_HF_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def _mlp(h: int, ffn: int, gated: bool) -> list[int]:
    return [h * ffn, ffn * h, h * ffn] if gated else [h * ffn, ffn, ffn * h, h]


def _sparse_layers(cfg: dict, layers: int) -> int:
    """How many of ``layers`` are MoE layers (Qwen-MoE's and DeepSeek's rules for the dense ones)."""
    step = _positive(cfg, "decoder_sparse_step") or 1
    first = _positive(cfg, "first_k_dense_replace") or 0
    only = cfg.get("mlp_only_layers") if isinstance(cfg.get("mlp_only_layers"), list) else []
    return sum(1 for i in range(layers) if i >= first and i not in only and (i + 1) % step == 0)


def _shared_experts(cfg: dict, h: int, gated: bool) -> list[int]:
    """Shared experts beside the routed ones: Qwen2-MoE's (with a 1-wide gate), DeepSeek's."""
    if width := _positive(cfg, "shared_expert_intermediate_size"):
        return _mlp(h, width, gated) + [h]
    if count := _positive(cfg, "n_shared_experts"):
        return _mlp(h, count * (_positive(cfg, "moe_intermediate_size") or h), gated)
    return []


def from_module(model: Any, name: str = "") -> ModelShape:
    """The shape of a built ``torch.nn.Module`` (real or on the meta device).

    Trainable parameters only; a tensor shared by several modules counts once (by identity, so
    meta tensors, which share no storage address, are deduplicated too). ``largest_layer`` is the
    most parameters any one module holds itself. Expert parameters (DeepSpeed's MoE marks) count
    every expert of the layer, also those a model built at ``ep_size`` N leaves to other ranks.
    """
    from dslaunch.runtime.moe.layer import MoE
    from dslaunch.runtime.moe.utils import expert_group_name
    from dslaunch.runtime.parallel.groups import ep_size_of

    trained = {id(p): p for p in model.parameters() if p.requires_grad}
    params = {k: p.numel() for k, p in trained.items()}
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # a model built at ep_size N holds 1/N of its experts: every expert counts
    held = {k: ep_size_of(group) or 1 for k, p in trained.items() if (group := expert_group_name(p)) is not None}
    experts = sum(params[k] * n for k, n in held.items())
    total = sum(params.values()) - sum(params[k] for k in held) + experts
    num_experts = max((m.num_experts for m in model.modules() if isinstance(m, MoE)), default=None)
    return ModelShape(params=total, largest_layer=min(largest, total), param_sizes=tuple(params.values()),
                      buffer_bytes=buffers, expert_params=experts, num_experts=num_experts, name=name)


def from_builder(spec: str) -> ModelShape:
    """The shape of the model ``"pkg.module:function"`` returns, built on the meta device.

    The function is called with no arguments inside ``torch.device("meta")``, so no weight is
    allocated; the current directory is on ``sys.path`` (as for ``python -m``).

    Raises:
        UsageError: the spec is malformed, the module or function is missing, or it returns no module.
    """
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name.isidentifier():
        raise UsageError(f"--model {shorten(spec, 200)}: expected MODULE:FUNCTION (e.g. mypkg.models:build)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"--model {shorten(spec, 200)}: cannot import {module_name}: {shorten(str(err), 200)}") from None
    build = getattr(module, func_name, None)
    if not callable(build):
        raise UsageError(f"--model {shorten(spec, 200)}: {module_name} has no function {func_name}")
    import torch

    try:
        with torch.device("meta"):
            model = build()
    except Exception as err:  # the user's code: say where it failed, in one line
        raise UsageError(f"--model {shorten(spec, 200)}: {func_name}() raised {type(err).__name__}: "
                         f"{shorten(str(err), 200)} (it is called with no arguments on the meta device)") from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model {shorten(spec, 200)}: {func_name}() returned {type(model).__name__}, "
                         "not a torch.nn.Module")
    return from_module(model, name=spec)
