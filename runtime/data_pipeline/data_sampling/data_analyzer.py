"""``deepspeed.runtime.data_pipeline.data_sampling.data_analyzer``: DeepSpeed's ``DataAnalyzer``,
which measures every sample of a dataset once (a map over workers and threads, then a reduce) and
writes the index files the curriculum sampler reads.

For a metric ``m`` of type ``single_value_per_sample`` (one integer per sample, e.g. its length)
the reduce writes, under ``<save_path>/m/``, indexed datasets (``indexed_dataset.py``):

- ``m_sample_to_metric``: item i is sample i's value;
- ``m_index_to_metric``: the distinct values, ascending, one per item;
- ``m_index_to_sample``: item k lists the samples whose value is the k-th distinct value;
- ``m_index_to_sample_percentile_merged``: those lists merged into about 100 items.

A metric of type ``accumulate_value_over_samples`` (e.g. a vocabulary histogram) sums the
function's values over all samples into ``m_metric_value``. Map workers (``num_workers``, each
``worker_id`` a separate job, ``num_threads`` processes each) write their partial results under
``m/worker<w>_thread<t>/`` (the sample-to-metric values and one ``m_metric_to_sample_<value>.csv``
per value, as DeepSpeed's); ``run_reduce`` (one process, after every map ended) merges them.
The files are DeepSpeed's byte for byte for the same dataset, metric functions and split (a test
compares them), so the two read each other's partial and final files.

Differences from DeepSpeed: a map thread that fails fails ``run_map`` naming it (DeepSpeed's joins
and goes on, then its reduce asserts on a count); the reduce merges in this process, one chunk after
another (``num_threads_reduce`` still names the chunk files, whose contents are the same); a
metric function returning the wrong dtype or a non-tensor is a ``UsageError`` naming the metric
(DeepSpeed asserts); nothing is printed per batch. ``DistributedDataAnalyzer`` (the analysis
spread over a torch.distributed group, no files between map and reduce) is not implemented:
refused on use.
"""

from __future__ import annotations

import csv
import io
import multiprocessing
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dslaunch.errors import UsageError
from dslaunch.runtime.data_pipeline import DATA_EFFICIENCY
from dslaunch.runtime.data_pipeline.data_sampling.indexed_dataset import valid_dtypes
from dslaunch.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    split_dataset,
)
from dslaunch.safe_write import make_dirs, remove_file, write_file
from dslaunch.utils.refused import refuse

_REFUSED = ("DistributedDataAnalyzer",)  # the analysis over a torch.distributed group
globals().update(refuse(__name__, _REFUSED, DATA_EFFICIENCY))
__all__ = ["DataAnalyzer", *_REFUSED]

_SINGLE, _ACCUMULATE = "single_value_per_sample", "accumulate_value_over_samples"


def _part_dir(save_path: str, metric: str, worker: int, thread: int) -> str:
    return f"{save_path}/{metric}/worker{worker}_thread{thread}/"


class DataAnalyzer:
    """Measure a dataset sample by sample (DeepSpeed's arguments and defaults).

    Args:
        dataset: a map-style dataset.
        num_workers, worker_id: this job's share of the dataset (``split_dataset``).
        num_threads: map processes of this worker; ``specific_threads`` runs only those.
        num_threads_reduce: chunks of the reduce (their files are named by it).
        batch_size, collate_fn: how the map reads the dataset (a torch ``DataLoader``).
        metric_names, metric_functions, metric_types, metric_dtypes: one entry per metric; a function
            takes a batch and returns a tensor or array of its dtype, one value per sample (or the
            batch's contribution to an accumulated value).
        save_path: the root of the output files.
        custom_map_init, custom_map_update, custom_map_finalize, custom_reduce: replace the default
            steps (same arguments as DeepSpeed's).
        sample_indices: the dataset index of each position of iteration (a shuffled dataset).

    Raises:
        UsageError: a metric type or dtype the files cannot hold.
    """

    def __init__(self, dataset: Any, num_workers: int = 1, worker_id: int = 0, num_threads: int = 1,
                 num_threads_reduce: int = 1, specific_threads: Sequence[int] = (), batch_size: int = 1,
                 metric_names: Sequence[str] = (), metric_functions: Sequence[Callable] = (),
                 metric_types: Sequence[str] = (), metric_dtypes: Sequence[Any] = (), save_path: str = "./",
                 collate_fn: Callable | None = None, custom_map_init: Callable | None = None,
                 custom_map_update: Callable | None = None, custom_map_finalize: Callable | None = None,
                 custom_reduce: Callable | None = None, sample_indices: Sequence[int] | None = None):
        for name, kind, dtype in zip(metric_names, metric_types, metric_dtypes, strict=False):
            if kind not in (_SINGLE, _ACCUMULATE):
                raise UsageError(f"DataAnalyzer metric {name!r}: metric_type {kind!r} is not one of {_SINGLE}, "
                                 f"{_ACCUMULATE}")
            if dtype not in valid_dtypes:
                raise UsageError(f"DataAnalyzer metric {name!r}: metric_dtype {dtype} cannot be stored; use an "
                                 "integer numpy or torch dtype (e.g. torch.int64)")
        self.dataset, self.num_workers, self.worker_id = dataset, num_workers, worker_id
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size, self.collate_fn = batch_size, collate_fn
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), list(metric_dtypes)
        self.save_path = save_path
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce
        self.sample_indices = sample_indices

    # ------------------------------------------------------------------ map

    def init_metric_results(self, thread_id: int, metric_names: Sequence[str], metric_types: Sequence[str],
                            metric_dtypes: Sequence[Any], save_path: str, worker_id: int) -> list[dict]:
        """Open one thread's partial outputs (old per-value csv files are removed)."""
        results = []
        for name, kind, dtype in zip(metric_names, metric_types, metric_dtypes, strict=True):
            where = _part_dir(save_path, name, worker_id, thread_id)
            make_dirs(where)
            if kind == _SINGLE:
                _remove_csvs(where, f"{name}_metric_to_sample_")
                fname = f"{where}/{name}_sample_to_metric"
                results.append({"sample_to_metric_fname": fname,
                                "sample_to_metric_builder": create_mmap_dataset_builder(fname, dtype),
                                "metric_to_sample_fname": f"{where}/{name}_metric_to_sample",
                                "metric_to_sample_dict": defaultdict(list)})
            else:
                results.append({"metric_value": None, "metric_value_fname": f"{where}/{name}_metric_value"})
        return results

    def update_metric_results(self, data: Any, metric_types: Sequence[str], metric_dtypes: Sequence[Any],
                              metric_functions: Sequence[Callable], metric_results: list[dict],
                              batch_start_idx: int = 0) -> None:
        """Add one batch (whose first sample is at ``batch_start_idx`` of the iteration)."""
        import torch

        for m, (kind, dtype, function, result) in enumerate(zip(metric_types, metric_dtypes, metric_functions,
                                                                metric_results, strict=True)):
            values = function(data)
            if not (torch.is_tensor(values) or isinstance(values, np.ndarray)) or values.dtype != dtype:
                raise UsageError(f"DataAnalyzer metric {self.metric_names[m]!r}: its function returned "
                                 f"{type(values).__name__} of {getattr(values, 'dtype', None)}; it must return a tensor "
                                 f"or array of {dtype}")
            values = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
            if kind == _SINGLE:
                for row in range(values.size()[0]):
                    result["sample_to_metric_builder"].add_item(values[row].reshape(-1))
                    result["metric_to_sample_dict"][values[row].item()].append(self._sample_id(data, row,
                                                                                               batch_start_idx))
            elif result["metric_value"] is None:
                result["metric_value"] = values.clone()
            else:
                result["metric_value"].add_(values)

    def _sample_id(self, data: Any, row: int, batch_start_idx: int) -> int:
        if isinstance(data, dict) and "index" in data:  # Megatron's batches name their samples
            return int(data["index"][row][0].item())
        position = batch_start_idx + row
        return int(self.sample_indices[position]) if self.sample_indices is not None else position

    def finalize_metric_results(self, metric_types: Sequence[str], metric_dtypes: Sequence[Any],
                                metric_results: list[dict]) -> None:
        """Close one thread's partial outputs."""
        for kind, dtype, result in zip(metric_types, metric_dtypes, metric_results, strict=True):
            if kind == _SINGLE:
                close_mmap_dataset_builder(result["sample_to_metric_builder"], result["sample_to_metric_fname"])
                for value, samples in result["metric_to_sample_dict"].items():
                    if samples:
                        _write_csv_row(f"{result['metric_to_sample_fname']}_{value}.csv", samples)
            elif result["metric_value"] is not None:
                builder = create_mmap_dataset_builder(result["metric_value_fname"], dtype)
                builder.add_item(result["metric_value"].reshape(-1))
                close_mmap_dataset_builder(builder, result["metric_value_fname"])

    def run_map_helper(self, thread_id: int) -> None:
        """One map thread: its slice of this worker's share, in order."""
        from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

        start, end = self.thread_splits[thread_id]
        subset = Subset(self.dataset, list(range(start, end)))
        loader = DataLoader(subset, batch_sampler=BatchSampler(SequentialSampler(subset), self.batch_size, False),
                            num_workers=0, collate_fn=self.collate_fn, pin_memory=False)
        init = self.custom_map_init or self.init_metric_results
        results = init(thread_id, self.metric_names, self.metric_types, self.metric_dtypes, self.save_path,
                       self.worker_id)
        update = self.custom_map_update or self.update_metric_results
        done = 0
        for data in loader:
            update(data, self.metric_types, self.metric_dtypes, self.metric_functions, results, start + done)
            done += len(data)
        finalize = self.custom_map_finalize or self.finalize_metric_results
        finalize(self.metric_types, self.metric_dtypes, results)

    def run_map(self) -> None:
        """This worker's map: its threads in processes of their own (in this process for one).

        Raises:
            UsageError: a map thread failed (named with its exit code).
        """
        self.worker_splits, self.thread_splits = split_dataset(self.dataset, self.num_workers, self.worker_id,
                                                               self.num_threads)
        threads = self.specific_threads or list(range(self.num_threads))
        if self.num_threads == 1:
            self.run_map_helper(0)
            return
        context = multiprocessing.get_context("fork")  # the metric functions need not pickle
        procs = [context.Process(target=self.run_map_helper, args=(t,)) for t in threads]
        for proc in procs:
            proc.start()
        for thread, proc in zip(threads, procs, strict=True):
            proc.join()
            if proc.exitcode != 0:
                raise UsageError(f"DataAnalyzer: map thread {thread} of worker {self.worker_id} failed (exit code "
                                 f"{proc.exitcode}); its partial files under {self.save_path} are incomplete")

    # ------------------------------------------------------------------ reduce

    def run_reduce(self) -> None:
        """Merge every worker's and thread's partial files (after all maps ended)."""
        if self.custom_reduce is not None:
            self.custom_reduce(self.dataset, self.metric_names, self.metric_types, self.save_path, self.num_workers,
                               self.num_threads, self.num_threads_reduce)
            return
        from dslaunch.runtime.data_pipeline.data_sampling.data_reduce import merge_map_results

        merge_map_results(len(self.dataset), self.metric_names, self.metric_types, self.save_path, self.num_workers,
                          self.num_threads, self.num_threads_reduce)

    def run_map_reduce(self, comm_group: Any = None) -> None:
        """Map on every rank of ``comm_group``, reduce on worker 0 (collective: call on all ranks)."""
        import torch.distributed as dist

        joined = dist.is_available() and dist.is_initialized()
        self.run_map()
        if joined:
            dist.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        if joined:
            dist.barrier(group=comm_group)

    @staticmethod
    def output_index_to_sample_percentile(index_to_sample_fname: str, index_to_metric_fname: str, metric_name: str,
                                          metric_save_path: str, total_num_samples: int,
                                          sample_idx_dtype: Any) -> dict:
        """Write ``<metric>_index_to_sample_percentile_merged``; the number of samples per value."""
        from dslaunch.runtime.data_pipeline.data_sampling.data_reduce import percentile_merged

        return percentile_merged(index_to_sample_fname, index_to_metric_fname, metric_name, metric_save_path,
                                 total_num_samples, sample_idx_dtype)


def _remove_csvs(where: str, prefix: str) -> None:
    for name in os.listdir(where):
        if name.startswith(prefix) and name.endswith(".csv"):
            remove_file(where, name)


def _write_csv_row(path: str, samples: list[int]) -> None:
    text = io.StringIO()
    csv.writer(text).writerow(samples)
    write_file(os.path.dirname(path) or ".", os.path.basename(path), text.getvalue())

