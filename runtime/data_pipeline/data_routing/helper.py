"""``deepspeed.runtime.data_pipeline.data_routing.helper``: refused on use (see ``runtime/data_pipeline/__init__.py``)."""

from dslaunch.runtime.data_pipeline import DATA_EFFICIENCY
from dslaunch.utils.refused import refuse

_REFUSED = ("convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd",)
globals().update(refuse(__name__, _REFUSED, DATA_EFFICIENCY))

__all__ = [*_REFUSED]
