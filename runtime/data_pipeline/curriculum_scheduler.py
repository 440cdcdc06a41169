"""``deepspeed.runtime.data_pipeline.curriculum_scheduler``: refused on use (see ``runtime/data_pipeline/__init__.py``)."""

from dslaunch.runtime.data_pipeline import DATA_EFFICIENCY
from dslaunch.utils.refused import refuse

_REFUSED = ("CurriculumScheduler",)
globals().update(refuse(__name__, _REFUSED, DATA_EFFICIENCY))

__all__ = [*_REFUSED]
