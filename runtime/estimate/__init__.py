"""Memory estimates for training jobs (``dslaunch estimate``, the autotuner's pruning).

The library API, torch-free::

    from dslaunch.runtime.estimate import ModelShape, TrainingSetup, estimate_memory

    shape = ModelShape.from_counts(7e9, largest_layer=131e6, hidden=4096, layers=32, heads=32, vocab=32000)
    est = estimate_memory(shape, ds_config_dict, gpus_per_node=8, nodes=1, seq_len=2048)
    est.device_bytes, est.host_bytes, est.fits(80 * 2**30)

- ``shape.py``: ``ModelShape`` and its sources (``from_hf_config``, ``from_module``, ``from_builder``).
- ``setup.py``: ``TrainingSetup`` (a ds_config's memory-relevant part + the cluster).
- ``memory.py``: ``estimate_memory`` -> ``MemoryEstimate`` (``Parts`` by purpose on device, host, NVMe).
- ``sweep.py``: every stage/offload/precision combination, sorted by what fits, and its table.
- ``deepspeed_formulas.py``: DeepSpeed's own estimator formulas and table (the compatibility
  functions at ``deepspeed.runtime.zero.stage_1_and_2`` / ``stage3`` print them).
"""

from dslaunch.runtime.estimate.memory import MemoryEstimate, Parts, estimate_memory
from dslaunch.runtime.estimate.setup import OFFLOAD_DEVICES, OPTIMIZER_STATE_BYTES, PRECISIONS, TrainingSetup
from dslaunch.runtime.estimate.shape import ModelShape, from_builder, from_hf_config, from_module

__all__ = ["ModelShape", "from_hf_config", "from_module", "from_builder", "TrainingSetup", "Parts",
           "MemoryEstimate", "estimate_memory", "OPTIMIZER_STATE_BYTES", "PRECISIONS", "OFFLOAD_DEVICES"]
