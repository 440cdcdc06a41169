"""What the engine does for random-LTD: make the scheduler from the config, and hand the wrapped
layers their config, the scheduler and their numbers (``engine.random_ltd_initialize()``)."""

from __future__ import annotations

from collections import deque
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from dslaunch.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

__all__ = ["random_ltd_scheduler", "initialize_layers"]


def random_ltd_scheduler(config: Any) -> RandomLTDScheduler | None:
    """The scheduler of a parsed ds_config whose random-LTD is on (else None)."""
    if not config.data_efficiency.random_ltd_enabled:
        return None
    block = config.data_efficiency.data_routing.random_ltd
    return RandomLTDScheduler(block.as_dict(config.train_micro_batch_size_per_gpu, config.train_batch_size))


def initialize_layers(module: Any, config: Any, scheduler: RandomLTDScheduler | None) -> int:
    """Number the ``RandomLayerTokenDrop`` layers ``random_ltd_layer_id`` names (in module order, a
    layer matching when its id appears in its name, as DeepSpeed matches) and join them to the
    schedule; the number joined.

    Raises:
        ConfigError: random-LTD is off, or fewer layers matched than ``random_ltd_layer_num``.
    """
    key = "data_efficiency.data_routing.random_ltd"
    if scheduler is None:
        raise ConfigError("must be true to convert a model to random-LTD (convert_to_random_ltd / "
                          "random_ltd_initialize)", key=f"{key}.enabled")
    block = config.data_efficiency.data_routing.random_ltd
    settings = block.as_dict(config.train_micro_batch_size_per_gpu, config.train_batch_size)
    queue, count = deque(sorted(block.random_ltd_layer_id)), 0
    for name, layer in module.named_modules():
        if isinstance(layer, RandomLayerTokenDrop) and queue and str(queue[0]) in name:
            layer.init_config(settings, scheduler, count)
            queue.popleft()
            count += 1
    if count != block.random_ltd_layer_num:
        raise ConfigError(f"{block.random_ltd_layer_num} but {count} wrapped layer(s) matched random_ltd_layer_id "
                          f"{list(block.random_ltd_layer_id)}; wrap the layers with convert_to_random_ltd first",
                          key=f"{key}.random_ltd_layer_num")
    return count
