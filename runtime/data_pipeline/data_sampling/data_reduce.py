"""The reduce of ``DataAnalyzer``: every map worker's and thread's partial files merged into the
metric index files the curriculum sampler reads (``data_analyzer.py`` says which files).

The merge goes in DeepSpeed's order, through the same chunk files
(``<metric>_sample_to_metric_thread<t>``, ``..._index_to_sample_thread<t>``,
``..._index_to_metric_thread<t>`` for each of ``num_threads_reduce`` chunks), so that each final
file is DeepSpeed's byte for byte, its document index included; the chunks are merged in this
process, one after another.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from dslaunch.errors import UsageError
from dslaunch.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from dslaunch.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
    split_index,
)

__all__ = ["merge_map_results", "percentile_merged"]


def _parts(save: str, metric: str, workers: int, threads: int) -> list[tuple[int, int, str]]:
    return [(w, t, f"{save}/worker{w}_thread{t}/") for w in range(workers) for t in range(threads)]


def _long(values: Any) -> Any:
    import torch

    return torch.tensor(np.asarray(values).astype(np.int64), dtype=torch.long)


def _merged(fname: str, dtype: Any, chunks: Sequence[str]) -> None:
    builder = create_mmap_dataset_builder(fname, dtype)
    for chunk in chunks:
        builder.merge_file_(chunk)
    close_mmap_dataset_builder(builder, fname)


def _single(total: int, metric: str, save: str, workers: int, threads: int, reduce: int) -> None:
    parts = _parts(save, metric, workers, threads)
    datasets = [MMapIndexedDataset(f"{where}/{metric}_sample_to_metric", skip_warmup=True) for _, _, where in parts]
    counted = sum(len(d) for d in datasets)
    if counted != total:
        raise UsageError(f"DataAnalyzer reduce of {metric!r}: the map files under {save} hold {counted} samples, the "
                         f"dataset {total}; run every map worker and thread to its end first")
    values = sorted({v.item() for d in datasets for v in np.unique(np.concatenate(list(d[:]) or [np.empty(0)]))})
    value_dtype = find_fit_int_dtype(values[0], values[-1])
    sample_dtype = find_fit_int_dtype(0, total - 1)
    for t, (start, end) in enumerate(split_index(0, len(parts), reduce)):  # sample -> metric, by chunk
        fname = f"{save}/{metric}_sample_to_metric_thread{t}"
        builder = create_mmap_dataset_builder(fname, value_dtype)
        for data in datasets[start:end]:
            for row in range(len(data)):
                builder.add_item(_long(data[row]))
        close_mmap_dataset_builder(builder, fname)
    _merged(f"{save}/{metric}_sample_to_metric", value_dtype,
            [f"{save}/{metric}_sample_to_metric_thread{t}" for t in range(reduce)])
    for t, (start, end) in enumerate(split_index(0, len(values), reduce)):  # metric -> samples, by chunk
        to_sample = create_mmap_dataset_builder(f"{save}/{metric}_index_to_sample_thread{t}", sample_dtype)
        to_metric = create_mmap_dataset_builder(f"{save}/{metric}_index_to_metric_thread{t}", value_dtype)
        for value in values[start:end]:
            to_sample.add_item(_long(_samples_of(parts, metric, value)))
            to_metric.add_item(_long([value]))
        close_mmap_dataset_builder(to_sample, f"{save}/{metric}_index_to_sample_thread{t}")
        close_mmap_dataset_builder(to_metric, f"{save}/{metric}_index_to_metric_thread{t}")
    for kind, dtype in (("index_to_sample", sample_dtype), ("index_to_metric", value_dtype)):
        _merged(f"{save}/{metric}_{kind}", dtype, [f"{save}/{metric}_{kind}_thread{t}" for t in range(reduce)])
    percentile_merged(f"{save}/{metric}_index_to_sample", f"{save}/{metric}_index_to_metric", metric, save, total,
                      sample_dtype)


def _samples_of(parts: Sequence[tuple[int, int, str]], metric: str, value: Any) -> list[int]:
    samples: list[int] = []
    for _, _, where in parts:
        path = f"{where}/{metric}_metric_to_sample_{value}.csv"
        if os.path.isfile(path):
            with open(path, newline="") as f:
                for row in csv.reader(f):
                    samples += [int(x) for x in row]
    return samples


def percentile_merged(index_to_sample_fname: str, index_to_metric_fname: str, metric_name: str,
                      metric_save_path: str, total_num_samples: int, sample_idx_dtype: Any) -> dict:
    """Write ``<metric>_index_to_sample_percentile_merged`` (the per-value lists in about 100 items);
    the number of samples per value.

    Raises:
        UsageError: the index files do not cover ``total_num_samples`` or their values do not rise.
    """
    to_sample = MMapIndexedDataset(index_to_sample_fname, skip_warmup=True)
    to_metric = MMapIndexedDataset(index_to_metric_fname, skip_warmup=True)
    per_value = {to_metric[i][0].item(): len(to_sample[i]) for i in range(len(to_sample))}
    rising = all(to_metric[i][0] > to_metric[i - 1][0] for i in range(1, len(to_metric)))
    if not rising or sum(per_value.values()) != total_num_samples:
        raise UsageError(f"{index_to_sample_fname}: its values do not rise or it does not list each of "
                         f"{total_num_samples} samples once; run the analyzer's reduce again")
    fname = f"{metric_save_path}/{metric_name}_index_to_sample_percentile_merged"
    builder = create_mmap_dataset_builder(fname, sample_idx_dtype)
    step = max(1, len(to_sample) // 100)
    for start in range(0, len(to_sample), step):
        builder.add_item(_long(np.concatenate(to_sample[start:min(len(to_sample), start + step)], axis=None)))
    close_mmap_dataset_builder(builder, fname)
    return per_value


def _accumulated(metric: str, save: str, workers: int, threads: int) -> None:
    total = None
    for _, _, where in _parts(save, metric, workers, threads):
        part = np.copy(MMapIndexedDataset(f"{where}/{metric}_metric_value", skip_warmup=True)[0])
        total = part if total is None else total + part
    fname = f"{save}/{metric}_metric_value"
    builder = create_mmap_dataset_builder(fname, find_fit_int_dtype(int(total.min()), int(total.max())))
    builder.add_item(_long(total))
    close_mmap_dataset_builder(builder, fname)


def merge_map_results(total: int, metric_names: Sequence[str], metric_types: Sequence[str], save_path: str,
                      num_workers: int, num_threads: int, num_threads_reduce: int) -> None:
    """The reduce of every metric (``total``: the dataset's length).

    Raises:
        UsageError: the map files are incomplete (named).
        DatasetFormatError: a map file is missing or unreadable.
    """
    for name, kind in zip(metric_names, metric_types, strict=True):
        save = f"{save_path}/{name}/"
        if kind == "single_value_per_sample":
            _single(total, name, save, num_workers, num_threads, num_threads_reduce)
        else:
            _accumulated(name, save, num_workers, num_threads)
