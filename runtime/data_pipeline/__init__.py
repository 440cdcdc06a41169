"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data-efficiency library. Its curriculum by step
(``curriculum_scheduler.py``, the ds_config's ``curriculum_learning``) is dslaunch's; the rest
(random-LTD in ``data_routing/``, data sampling by difficulty in ``data_sampling/``) is not: those
modules import (Megatron-DeepSpeed imports them at the top of its training script) and each name is
refused on use.
"""

from dslaunch.utils.refused import Refusal

DATA_EFFICIENCY = Refusal("DeepSpeed's data-efficiency library (random-LTD, curriculum by data sampling)",
                          "feed batches from a torch DataLoader/Sampler of your own (no 'data_efficiency' in ds_config)")

__all__ = ["DATA_EFFICIENCY"]
