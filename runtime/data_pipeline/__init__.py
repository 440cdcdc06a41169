"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data-efficiency library (curriculum learning,
random-LTD, data sampling by difficulty). dslaunch does not have it: its modules import (Megatron-
DeepSpeed imports them at the top of its training script) and each name is refused on use:
``curriculum_scheduler.py``, ``data_routing/`` (random-LTD), ``data_sampling/``.
"""

from dslaunch.utils.refused import Refusal

DATA_EFFICIENCY = Refusal("DeepSpeed's data-efficiency library (curriculum learning, random-LTD, data sampling)",
                          "feed batches from a torch DataLoader/Sampler of your own (no 'data_efficiency' in ds_config)")

__all__ = ["DATA_EFFICIENCY"]
