"""``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr``: refused on use (see ``runtime/data_pipeline/__init__.py``)."""

from dslaunch.runtime.data_pipeline import DATA_EFFICIENCY
from dslaunch.utils.refused import refuse

_REFUSED = ("get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",)
globals().update(refuse(__name__, _REFUSED, DATA_EFFICIENCY))

__all__ = [*_REFUSED]
