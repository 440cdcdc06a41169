"""``deepspeed.runtime.data_pipeline.data_routing.helper``: turning a model's layers into
random-LTD layers and saving it without them.

``convert_to_random_ltd(engine, LayerClass)`` wraps every ``LayerClass`` module of the engine's
model in a ``RandomLayerTokenDrop`` and calls ``engine.random_ltd_initialize()`` (the config's
``data_efficiency.data_routing.random_ltd`` must be on). ``save_without_random_ltd(engine)`` and
``remove_random_ltd_state_dict(sd)`` give the model's state dict under the unwrapped names (what
the plain model loads).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from dslaunch.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop

__all__ = ["convert_to_random_ltd", "save_without_random_ltd", "remove_random_ltd_state_dict"]


def _inner(model: Any) -> Any:
    return model.module if hasattr(model, "module") else model


def _replace(root: Any, name: str, new: Any) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, new)


def convert_to_random_ltd(model: Any, convert_type: type) -> Any:
    """Wrap every ``convert_type`` layer of ``model`` (an engine) and initialise random-LTD.

    Returns:
        ``model``.

    Raises:
        ConfigError: random-LTD not enabled in the engine's config, or the layer ids do not match.
    """
    root = _inner(model)
    for name in [n for n, m in root.named_modules() if isinstance(m, convert_type) and n]:
        _replace(root, name, RandomLayerTokenDrop(root.get_submodule(name)))
    model.random_ltd_initialize()
    return model


def remove_random_ltd_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict:
    """``state_dict`` with the wrappers' ``.random_ltd_layer`` taken out of every key."""
    return OrderedDict((key.replace(".random_ltd_layer", ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model: Any) -> OrderedDict:
    """The model's state dict under the names of the unwrapped model."""
    return remove_random_ltd_state_dict(_inner(model).state_dict())
