"""ZeRO: the data-parallel strategies the engine delegates to (stages 0-3), and DeepSpeed's zero API.

The engine picks a stage once from ``registry.STRATEGIES`` (the only list of stages) and never
asks the stage again. What lives where:

- ``registry.py``: stage -> strategy class; the valid stages for config validation and help text.
- ``optimizer_view.py``: ``engine.optimizer`` as DeepSpeed's wrapper classes (``DeepSpeedZeroOptimizer``,
  ``FP16_Optimizer``, ...), a view over the strategy, its torch optimizer and the loss scaler;
  ``gradient_views.py``: the gradient data those wrappers expose (``averaged_gradients``, per-group
  norms, flat fp32 gradients, every rank's weight partitions), read from the strategy.
- ``strategy.py``: ``ZeroStrategy``, the lifecycle the engine drives, the step every stage shares,
  and the checkpoint state format; ``reduce_part.py``: its groups that reduce over one process
  group (the data group's, each expert group's).
- ``stage0.py``, ``stage1.py``, ``stage2.py``, ``stage3.py``: each stage as a placement + a gradient
  path.
- ``placement.py``: where the fp32 master and optimizer state live (replicated or sharded).
- ``gradients.py``, ``sharded_gradients.py``: how gradients are kept and reduced (full buffer at
  the boundary; or into the rank's shard as backward runs); ``grad_norm.py``: the global norm's sums of squares, per unit, in
  one order whether a pass at the step or the gradients' last write (the fold) takes them.
- ``reducer.py``: the bucket reducer (and its buffer pool) both gradient paths use; ``exchange.py``:
  how a bucket is exchanged (all-reduce, reduce-scatter, 1-bit compressed).
- ``zeropp.py``: ZeRO++ at stage 3 (quantized gathers, hpZ, qgZ); ``quantize.py``: its block
  quantization.
- ``publisher.py``: broadcasting updated shards to every rank's model.
- ``shm.py``: the same-host shared-memory collectives (gradient sums, the publish, stage 3's
  gathers) where every rank of the group is on this host (``shared_memory_collectives``).
- ``flat.py``: a param group's flat storage; ``partition.py``: its layout and the partition rule.
- ``specs.py``: the records the engine hands a strategy and gets back.
- ``frozen.py``: what an engine without an optimizer (forward only) uses instead of a stage.
- ``stage3.py``: parameters partitioned too: ``partitioned.py`` (the placement: a shard per rank),
  ``params.py`` (a partitioned parameter: DeepSpeed's ``ds_*`` attributes, gather and release),
  ``fetcher.py`` (when: module forward hooks, saved-tensor hooks for backward), ``prefetch.py``
  (the recorded order of use: prefetch, live-parameter bound, reuse), ``persistent.py`` (the
  persistent parameters ``empty_partition_cache`` released, gathered again at their next use).
- ``partition_parameters.py``: DeepSpeed's user API (``Init``, ``GatheredParameters``,
  ``ZeroParamStatus``, external parameters), also importable as ``dslaunch.zero``;
  DeepSpeed's tensor-fragment API (``dslaunch.utils``): ``fragment.py`` (one parameter's piece of
  the master, gradient and optimizer state on this rank), ``full_state.py`` (``safe_get/set_full_*``)
  and ``local_state.py`` (stage 3's ``safe_get/set_local_*``).

- ``offload/``: the optimizer step of an offloaded master (``offload_optimizer``): buckets,
  transfers overlapped with the update, the optimizer state in host memory or NVMe swap files;
  stage 3's parameter shards on NVMe (``offload_param``, ``offload/param_store.py``).
- ``offload_states.py``: ``engine.offload_states``/``reload_states``, every state's storages moved to
  host memory and back between training phases (each owner names its tensors: ``state_holders``).
- ``leaf_modules.py``: the ZeRO-3 leaf-module flags (``set_z3_leaf_modules`` and the
  ``zero_optimization.leaf_module`` section) the fetcher reads.
- DeepSpeed's import paths: ``config.py`` (``DeepSpeedZeroConfig``), ``offload_config.py``,
  ``leaf_module_config.py``, ``mics.py`` (MiCS, refused on use), ``linear.py`` (its linear
  Function and module), ``stage_1_and_2.py`` (its memory estimator), ``tiling.py`` (``TiledLinear``),
  ``utils.py``
  (``ZeRORuntimeException`` and predicates), ``muon/``.

Importing this package does not import torch (``Init``, ``GatheredParameters``, ``ZeroParamStatus``,
``unwrap_model_for_generation`` and the external-parameter functions resolve on first access, as ``deepspeed.runtime.zero``'s).
"""

from __future__ import annotations

import importlib
from typing import Any

from dslaunch.runtime.zero.registry import STAGES, STRATEGIES, strategy_class

_API = ("Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
        "unregister_external_parameter", "unwrap_model_for_generation")

__all__ = ["STAGES", "STRATEGIES", "strategy_class", *_API, "MiCS_Init"]


def __getattr__(name: str) -> Any:
    if name == "MiCS_Init":  # refused on use (``mics.py``)
        return importlib.import_module(f"{__name__}.mics").MiCS_Init
    if name not in _API:
        raise AttributeError(f"module 'dslaunch.runtime.zero' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.partition_parameters"), name)
