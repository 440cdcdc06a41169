"""A converted model's state dict in the unconverted Hugging Face model's layout.

After AutoEP a rank holds rows ``[ep_rank * n, (ep_rank + 1) * n)`` of each fused expert weight,
under ``<block>.experts.<w>``, and the router under ``<block>.gate.router``. What a user saves
(``model.state_dict()`` in the Trainer's ``save_model``, ``engine.save_16bit_model``, the
consolidated 16-bit state dict) must load back into the Hugging Face class: ``unconverted`` puts
each block's expert weights together over its expert group (all ``num_experts`` rows, in expert
order) under the model's names, and the router's under the model's router name. ``local`` is the
inverse (a rank's rows of a whole weight), so the converted model also loads either layout.

``AutoEPMoE`` registers both as state-dict hooks: ``model.state_dict()`` is then collective on
every expert group (every rank must call it). dslaunch's own checkpoints keep each rank's rows
(``local_layout``), so a save never builds every expert on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["whole_rows", "unconverted", "local", "local_layout", "unconverted_state_dict", "whole_untrained",
           "local_state_dict"]

ROUTER = "gate.router."  # where RouterGate keeps the model's router
EXPERTS = "experts."  # MOELayer's name of its experts


def whole_rows(rows: Tensor, group: Any, ep_size: int) -> Tensor:
    """The expert group's slices of one fused weight, concatenated in expert order (rank ``r`` of
    the group holds slice ``r``). collective: the expert group."""
    if ep_size == 1 or group is None:
        return rows
    import torch.distributed as dist

    rows = rows.detach().contiguous()
    parts = [torch.empty_like(rows) for _ in range(ep_size)]
    dist.all_gather(parts, rows, group=group)
    return torch.cat(parts)


def _whole_local(value: Any, layer: Any) -> bool:
    """``value`` holds this rank's rows whole (not the placeholder of a weight ZeRO-3 partitioned,
    as a plain ``state_dict()`` gives it)."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == layer.num_local_experts


def unconverted(layer: Any, sd: dict, prefix: str) -> None:
    """Rewrite ``layer``'s entries of ``sd`` (under ``prefix``) in the model's layout, in place:
    whole expert weights under the model's experts name, the router under its own name. A
    weight ZeRO-3 has partitioned (a placeholder in a plain ``state_dict``) is only renamed.
    collective: the layer's expert group."""
    for name in filter(None, layer.experts.names):
        key = f"{prefix}{EXPERTS}{name}"
        if key not in sd:
            continue
        value = sd.pop(key)
        if _whole_local(value, layer):
            value = whole_rows(value, layer.ep_group, layer.ep_size)
        sd[f"{prefix}{layer.experts_name}.{name}"] = value
    for key in [k for k in sd if k.startswith(prefix + ROUTER)]:
        sd[f"{prefix}{layer.router_name}.{key[len(prefix + ROUTER):]}"] = sd.pop(key)


def local(layer: Any, sd: dict, prefix: str) -> None:
    """Rewrite the model's layout of ``layer``'s entries (whole expert weights, the router under
    its own name) into the converted one, in place: this rank's rows, ``gate.router``. Entries
    already converted (``num_experts / ep_size`` rows, ``gate.router.``) are left as they are."""
    first = layer.ep_rank * layer.num_local_experts
    for name in filter(None, layer.experts.names):
        mine = f"{prefix}{EXPERTS}{name}"
        for key in dict.fromkeys((f"{prefix}{layer.experts_name}.{name}", mine)):
            value = sd.get(key)
            if not isinstance(value, Tensor) or (key == mine and value.shape[0] != layer.num_experts):
                continue
            if value.shape[0] == layer.num_experts:
                value = value[first:first + layer.num_local_experts]
            del sd[key]
            sd[mine] = value
            break
    for name in layer.gate.router.state_dict(keep_vars=True):
        key, mine = f"{prefix}{layer.router_name}.{name}", f"{prefix}{ROUTER}{name}"
        if key in sd and mine not in sd:
            sd[mine] = sd.pop(key)


def _autoep_layers(module: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    for name, m in module.named_modules():
        if hasattr(m, "router_name") and hasattr(m, "_local_layout"):
            yield (f"{name}." if name else ""), m


@contextlib.contextmanager
def local_layout(module: torch.nn.Module) -> Iterator[None]:
    """Within: ``module.state_dict()`` keeps each rank's rows (the hooks step aside); local, no
    collective."""
    layers = [m for _, m in _autoep_layers(module)]
    before = [m._local_layout for m in layers]
    for m in layers:
        m._local_layout = True
    try:
        yield
    finally:
        for m, was in zip(layers, before, strict=True):
            m._local_layout = was


def unconverted_state_dict(module: torch.nn.Module, sd: dict) -> dict:
    """``sd`` (``module``'s state dict in the converted layout, every weight whole on this rank)
    in the unconverted model's layout; unchanged without AutoEP blocks. collective: every rank."""
    for prefix, layer in _autoep_layers(module):
        unconverted(layer, sd, prefix)
    return sd


def whole_untrained(module: torch.nn.Module, sd: dict, trained: set[str]) -> dict:
    """``sd`` (the converted layout, as dslaunch's checkpoints save it) with each AutoEP block's
    expert entries that no optimizer holds (frozen weights, buffers with a row per local expert)
    made whole over the expert group, under their own names: the module file, written by one
    rank, then keeps every rank's experts, and ``local`` takes a rank's rows back at any
    ``autoep_size``. collective: every rank."""
    for prefix, layer in _autoep_layers(module):
        for key in [k for k in sd if k.startswith(prefix + EXPERTS) and k not in trained]:
            if _whole_local(sd[key], layer):
                sd[key] = whole_rows(sd[key], layer.ep_group, layer.ep_size)
    return sd


def local_state_dict(module: torch.nn.Module, sd: dict) -> dict:
    """``sd`` with every AutoEP block's entries in the converted layout (``local``); local."""
    sd = dict(sd)
    for prefix, layer in _autoep_layers(module):
        local(layer, sd, prefix)
    return sd


def save_hook(layer: Any, sd: dict, prefix: str, local_metadata: Any) -> None:
    """``AutoEPMoE``'s state-dict post-hook."""
    if not layer._local_layout:
        unconverted(layer, sd, prefix)


def load_hook(layer: Any, sd: dict, prefix: str, *args: Any) -> None:
    """``AutoEPMoE``'s load-state-dict pre-hook."""
    local(layer, sd, prefix)
