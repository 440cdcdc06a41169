"""``deepspeed.runtime.data_pipeline.data_sampling.utils``: the small helpers the analyzer and the
sampler share: the narrowest integer dtype for a range of values, splitting a range among workers,
and opening/closing a one-document mmap builder at a prefix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dslaunch.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDatasetBuilder

__all__ = ["find_fit_int_dtype", "split_index", "split_dataset", "create_mmap_dataset_builder",
           "close_mmap_dataset_builder"]


def find_fit_int_dtype(min_value: int, max_value: int) -> Any:
    """The narrowest numpy integer type holding [min_value, max_value] (unsigned when min >= 0)."""
    if min_value >= 0:
        for dtype in (np.uint8, np.uint16, np.uint32):
            if max_value <= np.iinfo(dtype).max:
                return dtype
        return np.uint64
    for dtype in (np.int8, np.int16, np.int32):
        if np.iinfo(dtype).min <= min_value and max_value <= np.iinfo(dtype).max:
            return dtype
    return np.int64


def split_index(start_idx: int, end_idx: int, num_partitions: int) -> list[tuple[int, int]]:
    """[start_idx, end_idx) cut into ``num_partitions`` near-equal consecutive ranges."""
    bounds = np.linspace(start_idx, end_idx, dtype=int, num=num_partitions + 1)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(num_partitions)]


def split_dataset(dataset: Any, num_workers: int, worker_id: int,
                  num_threads: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every worker's range of ``dataset``, and worker ``worker_id``'s range cut among its threads."""
    worker_splits = split_index(0, len(dataset), num_workers)
    return worker_splits, split_index(*worker_splits[worker_id], num_threads)


def create_mmap_dataset_builder(fname: str, dtype: Any) -> MMapIndexedDatasetBuilder:
    """A builder writing ``<fname>.bin``."""
    return MMapIndexedDatasetBuilder(f"{fname}.bin", dtype=dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, fname: str) -> None:
    """End the (one) document and write ``<fname>.idx``."""
    builder.end_document()
    builder.finalize(f"{fname}.idx")
