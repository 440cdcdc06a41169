"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data-efficiency library. Its curriculum by step
(``curriculum_scheduler.py``, the ds_config's ``curriculum_learning``), its curriculum by data
sampling (``data_sampling/``, ``data_efficiency.data_sampling``, with its variable batch size
loader) and random-LTD (``data_routing/``, ``data_efficiency.data_routing.random_ltd``) are
dslaunch's; the distributed analyzer (``DistributedDataAnalyzer``) is not: it imports and is refused
on use.
"""

from dslaunch.utils.refused import Refusal

DATA_EFFICIENCY = Refusal("DeepSpeed's analysis of a dataset over a torch.distributed group",
                          "use DataAnalyzer with num_workers/worker_id on each rank and run_map_reduce()")

__all__ = ["DATA_EFFICIENCY"]
