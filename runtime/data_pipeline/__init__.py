"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data-efficiency library. Its curriculum by step
(``curriculum_scheduler.py``, the ds_config's ``curriculum_learning``) and its curriculum by data
sampling (``data_sampling/``, the ds_config's ``data_efficiency.data_sampling``) are dslaunch's;
random-LTD (``data_routing/``), the variable batch size loader and the distributed analyzer are
not: those modules import (Megatron-DeepSpeed imports them at the top of its training script) and
each name is refused on use.
"""

from dslaunch.utils.refused import Refusal

DATA_EFFICIENCY = Refusal("this part of DeepSpeed's data-efficiency library (random-LTD, variable batch size, "
                          "distributed data analysis)",
                          "curriculum by data sampling (data_efficiency.data_sampling) and DataAnalyzer are "
                          "implemented; for the rest feed batches from a torch DataLoader/Sampler of your own")

__all__ = ["DATA_EFFICIENCY"]
