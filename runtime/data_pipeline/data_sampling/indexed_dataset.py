"""``deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset``: refused on use (see ``runtime/data_pipeline/__init__.py``)."""

from dslaunch.runtime.data_pipeline import DATA_EFFICIENCY
from dslaunch.utils.refused import refuse

_REFUSED = ("MMapIndexedDataset", "MMapIndexedDatasetBuilder",)
globals().update(refuse(__name__, _REFUSED, DATA_EFFICIENCY))

__all__ = [*_REFUSED]
