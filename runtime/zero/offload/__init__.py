"""ZeRO-Offload and ZeRO-Infinity: the optimizer step of a host-resident master, NVMe swap space.

What lives where:

- ``step.py``: ``OffloadedStep``, the step of ``offload_optimizer`` (stages 1-3): the host master
  shard updated in buckets (``sub_group_size``), gradients streamed in and updated parameters
  streamed back one bucket ahead/behind, the optimizer state in host memory (``device: cpu``) or
  swapped through a file per rank (``device: nvme``), with read-ahead and write-behind.
- ``rules.py``: the update of one bucket for the optimizers with CPU kernels (Adam/AdamW fused with
  the 16-bit copy, Adagrad, Lion); other optimizers run torch's own step over the whole shard.
- ``phases.py``: ``PhaseClock``/``StepPhases``, an offloaded step's time by phase (norm, gradients
  in, update, state I/O, write-back) and the bytes its copies moved.
- ``split.py``: ``SplitState``, partial offload (``ratio`` < 1, stage 3): the optimizer state cut
  into a device part (updated by the device kernel) and a host part (updated by ``step.py``).
- ``swap.py``: ``SwapFile``, a rank's nameless swap file (freed by the kernel at any exit) read and
  written by a thread pool of ``os.preadv``/``os.pwritev`` (``aio.block_size``/``queue_depth``).

- ``param_store.py``: ``ShardStore``, ZeRO-Infinity's parameter side (``offload_param`` with
  ``device: nvme``): one param group's stage-3 shard in a ``SwapFile`` (but ``max_in_cpu``
  elements), read by range for gathers, written back by the step, staged through a bounded pool.

Not here: ``offload_param: cpu`` (stage 3's parameter shards in host memory,
``runtime/zero/partitioned.py``).
"""
