"""ZeRO: the data-parallel strategies the engine delegates to (stages 0-2; room for stage 3).

The engine picks a stage once from ``registry.STRATEGIES`` (the only list of stages) and never
asks the stage again. What lives where:

- ``registry.py``: stage -> strategy class; the valid stages for config validation and help text.
- ``strategy.py``: ``ZeroStrategy``, the lifecycle the engine drives, the step every stage shares,
  and the checkpoint state format.
- ``stage0.py``, ``stage1.py``, ``stage2.py``: each stage as a placement + a gradient path.
- ``placement.py``: where the fp32 master and optimizer state live (replicated or sharded).
- ``gradients.py``: how gradients are kept and reduced (full buffer at the boundary, or into the
  rank's shard as backward runs).
- ``reducer.py``: the bucket reducer (and its buffer pool) both gradient paths use.
- ``publisher.py``: broadcasting updated shards to every rank's model.
- ``flat.py``: a param group's flat storage; ``partition.py``: its layout and the partition rule.
- ``specs.py``: the records the engine hands a strategy and gets back.
- ``contexts.py``: DeepSpeed's ``zero.Init`` / ``zero.GatheredParameters`` below stage 3.
- ``frozen.py``: what an engine without an optimizer (forward only) uses instead of a stage.

Not written yet:

- ``stage3.py``: parameters partitioned too. A placement whose ``FlatGroup`` holds only this
  rank's shard, gathering parameters in ``pre_forward`` (or per-submodule hooks it registers
  there) and releasing them in ``post_backward``; gradients as stage 2's. Registered by one line
  in ``registry.STRATEGIES``, which also makes the config accept it.
- ``offload/``: optimizer state and master weights kept in CPU memory or on NVMe
  (``zero_optimization.offload_optimizer``/``offload_param``), as a placement that moves shards
  in and out around the optimizer step.

Importing this package does not import torch.
"""

from __future__ import annotations

from dslaunch.runtime.zero.contexts import GatheredParameters, Init
from dslaunch.runtime.zero.registry import STAGES, STRATEGIES, strategy_class

__all__ = ["STAGES", "STRATEGIES", "strategy_class", "GatheredParameters", "Init"]
