"""Tensor parallelism (AutoTP), for inference and training: one planner, one set of layers.

- ``auto_tp.py``: the planner (which Linears are column-, row- or vocab-parallel, from the model's
  dataflow and head geometry).
- ``layers.py``: the sharded layers that replace them.
- ``collectives.py``: the collectives those layers call; for training, autograd functions with
  the backward collective of each (column: all-reduce of the input gradient; row and embedding:
  all-reduce forward, identity backward; vocab: gather forward, slice backward).
- ``invariant.py``: layout-invariant training (the ``layout_invariant`` block): the column and row
  layers in fixed pieces summed in a fixed tree, the same bits at every degree.
- ``shard.py``: putting a plan's layers in place of a model's modules.
- ``training.py``: ``tensor_parallel.autotp_size`` in the training engine (the grid and the
  sharding at ``initialize``).
- ``loss.py``: the vocab-parallel cross entropy (``tensor_parallel.loss_parallel``): the logits
  stay split over the vocabulary.
- ``partition.py``: the plan from ``tensor_parallel.partition_config``'s hand-written rules
  instead of the dataflow; ``split.py``: DeepSpeed's sizes of a dimension's slices.
- ``deepspeed_layers.py``: DeepSpeed's layers built by hand around a Linear (``LinearLayer``,
  ``LinearAllreduce``); ``mode.py``: DeepSpeed's process-wide training/inference switch for them.
- ``consolidate.py``: the whole state dict of a split model (``_consolidated_16bit_state_dict``).

DeepSpeed's ``deepspeed.module_inject`` and ``deepspeed.inference`` answer from here.
"""

from dslaunch.runtime.tensor_parallel.mode import (
    AUTOTP_MODE,  # DeepSpeed's deepspeed.runtime.tensor_parallel.AUTOTP_MODE
)

__all__ = ["AUTOTP_MODE"]
