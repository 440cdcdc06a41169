"""``clone_tensors_for_torch_save``: tensors that own exactly their data, for ``torch.save``.

Why: dslaunch's parameters are views into ZeRO's flat buffers, and ``torch.save`` writes a view's
whole storage: a state dict of views would hold the flat buffer instead of each parameter's part,
and every loaded tensor would keep all of it alive. accelerate and transformers call this (DeepSpeed's helper)
on a model's state dict before saving it.

``get_model_ckpt_name_for_rank``, ``get_zero_ckpt_name_for_rank`` and ``get_layer_ckpt_name_for_rank``
name files of DeepSpeed's own layout (``runtime/checkpoint/deepspeed_layout.py``), which dslaunch
writes with ``"checkpoint": {"format": "deepspeed"}``.
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.runtime.checkpoint.deepspeed_layout import (
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)

__all__ = ["clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """``item`` with every tensor inside it (dicts, lists, tuples, nested) detached and copied to
    ``device`` into storage of its own; other values unchanged. Containers keep their types."""
    if torch.is_tensor(item):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, dict):
        return type(item)({key: clone_tensors_for_torch_save(value, device) for key, value in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(value, device) for value in item)
    return item
