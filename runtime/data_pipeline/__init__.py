"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data-efficiency library. Its curriculum by step
(``curriculum_scheduler.py``, the ds_config's ``curriculum_learning``), its curriculum by data
sampling (``data_sampling/``, ``data_efficiency.data_sampling``) and random-LTD (``data_routing/``,
``data_efficiency.data_routing.random_ltd``) are dslaunch's; the variable batch size loader and the
distributed analyzer are not: those names import and each is refused on use.
"""

from dslaunch.utils.refused import Refusal

DATA_EFFICIENCY = Refusal("this part of DeepSpeed's data-efficiency library (variable batch size and LR, "
                          "distributed data analysis)",
                          "curriculum by data sampling, DataAnalyzer and random-LTD are implemented; for the rest "
                          "feed batches from a torch DataLoader/Sampler of your own")

__all__ = ["DATA_EFFICIENCY"]
