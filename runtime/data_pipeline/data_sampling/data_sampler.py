"""``deepspeed.runtime.data_pipeline.data_sampling.data_sampler``: DeepSpeed's curriculum data
sampler, ``DeepSpeedDataSampler``: which samples make up each global batch while each metric's
difficulty rises.

At each global batch (one optimizer step) every metric's scheduler moves on one step. When a
difficulty changed, rank 0 makes a new *cluster*: the samples that newly qualify (by value: metric
in (previous, current]; by percentile: the next slice of the samples sorted by the metric; several
metrics: those within every metric's difficulty, less the earlier clusters), shuffled, written as
an indexed dataset ``<data_cluster_path>/cluster_<metric><difficulty>...``. A global batch draws
how many samples come from each cluster in proportion to the clusters' sizes, takes them in turn
from each cluster's shuffled order (reshuffling and rewriting a cluster used up), shuffles them,
and is broadcast from rank 0 to the data-parallel group; each micro step hands every rank its
share of the next ``micro_batch * dp_size`` of them.

Rank 0 draws everything from one ``numpy.random.default_rng(seed)`` in DeepSpeed's order, so for
the same seed, index files and batch sizes the batches are DeepSpeed's, sample for sample (tests
compare them with DeepSpeed 0.19.8's), and the cluster files are its bytes.

Differences from DeepSpeed: ``state_dict`` saves the sampler's own generator (DeepSpeed saves
numpy's global state instead, so a resumed DeepSpeed run draws other batches than the uninterrupted
one); a checkpoint of DeepSpeed's (the global state) still loads as DeepSpeed loads it.
``consumed_samples`` counts a micro batch when it is handed out, so a state taken while the caller
holds it points at the next one. Whether a new cluster exists is broadcast from rank 0 (DeepSpeed
has every rank look for its file, which needs a shared file system and is fooled by a stale file
of an earlier run). No sample qualifying at the first difficulty is a ``UsageError`` naming the
metric's bounds (DeepSpeed fails inside numpy).

Limitations: map-style datasets; the index files are read on rank 0 only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from dslaunch.errors import UsageError
from dslaunch.runtime.config.data_efficiency import DataEfficiencyConfig
from dslaunch.runtime.config.sections import parse_section
from dslaunch.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from dslaunch.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
from dslaunch.runtime.data_pipeline.data_sampling.utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
)
from dslaunch.safe_write import make_dirs

__all__ = ["DeepSpeedDataSampler", "parse_data_efficiency"]

_NONE = -1  # pads a global batch shorter than the broadcast tensor


def parse_data_efficiency(config: Mapping[str, Any] | DataEfficiencyConfig) -> DataEfficiencyConfig:
    """``config`` as parsed (a ``data_efficiency`` block, or the dict DeepSpeed's engine hands over).

    Raises:
        ConfigError: a bad block (one line naming the key).
    """
    if isinstance(config, DataEfficiencyConfig):
        return config
    parsed = parse_section(DataEfficiencyConfig, config, "data_efficiency")
    parsed.check()
    return parsed


class DeepSpeedDataSampler:
    """A batch sampler (indices of this rank's micro batches) driven by the curriculum.

    Args:
        data_efficiency_config: the ``data_efficiency`` block (dict or parsed).
        one_epoch_total_samples: the dataset's length.
        micro_batch_size: samples per rank per micro step.
        data_parallel_rank, data_parallel_size, data_parallel_group: the data-parallel group
            (None: the default group, or no communication with one rank).
        gradient_accumulation_steps: micro steps per global batch.
        global_rank: rank 0 makes the clusters and draws the batches.
        drop_last: a short last micro batch is dropped.

    Raises:
        ConfigError: a bad block, or curriculum learning not enabled in it.
        DatasetFormatError: an index file that cannot be read (rank 0).
    """

    def __init__(self, data_efficiency_config: Mapping[str, Any] | DataEfficiencyConfig, one_epoch_total_samples: int,
                 micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int, data_parallel_group: Any,
                 gradient_accumulation_steps: int, global_rank: int, drop_last: bool = True):
        config = parse_data_efficiency(data_efficiency_config)
        if not config.curriculum_enabled or micro_batch_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise UsageError("DeepSpeedDataSampler needs data_efficiency.data_sampling.curriculum_learning.enabled, "
                             f"a positive micro batch and 0 <= rank < size (got micro_batch_size={micro_batch_size}, "
                             f"rank {data_parallel_rank} of {data_parallel_size})")
        self.config = config
        self.one_epoch_total_samples = one_epoch_total_samples
        self.index_dtype = find_fit_int_dtype(0, one_epoch_total_samples)
        self.total_samples = one_epoch_total_samples * config.data_sampling.num_epochs
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.data_parallel_group = data_parallel_group
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self.np_rng = np.random.default_rng(config.seed)
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, int] = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.data_clusters: list[MMapIndexedDataset] = []
        self.data_cluster_sizes: list[int] = []
        self.data_1epoch_size: int | None = None
        self.cluster_root = config.curriculum.data_cluster_path
        self.metrics = dict(config.curriculum.curriculum_metrics)
        self.curriculum_schedulers = {name: CurriculumScheduler(m.schedule_block()) for name, m in self.metrics.items()}
        self.difficulty_type = {name: m.difficulty_type for name, m in self.metrics.items()}
        self.clustering_type = {name: m.clustering_type for name, m in self.metrics.items()}
        self.curriculum_index_to_sample: dict[str, MMapIndexedDataset] = {}
        self.curriculum_index_to_metric: dict[str, MMapIndexedDataset] = {}
        if self.global_rank == 0:
            make_dirs(self.cluster_root)
            for name, metric in self.metrics.items():
                if metric.clustering_type == "single_cluster":
                    continue
                self.curriculum_index_to_sample[name] = MMapIndexedDataset(metric.index_to_sample_path, True)
                if metric.difficulty_type == "value":
                    self.curriculum_index_to_metric[name] = MMapIndexedDataset(metric.index_to_metric_path, True)

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], int]]) -> None:
        """The ``custom`` schedules' functions, metric name -> (step -> difficulty)."""
        for name, scheduler in self.curriculum_schedulers.items():
            if name in schedule_func_dict:
                scheduler.set_custom_get_difficulty(schedule_func_dict[name])

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's [start, end) in a micro step's ``batch_len`` indices (default: a full one)."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size
        size = self.data_parallel_size
        return (round(self.data_parallel_rank * batch_len / size), round((self.data_parallel_rank + 1) * batch_len / size))

    # ------------------------------------------------------------------ clusters (rank 0)

    def get_sample_based_on_metric_value(self, metric: str, value_start: float, value_end: float) -> np.ndarray | None:
        """The samples whose ``metric`` is in (value_start, value_end], in index order."""
        values, samples = self.curriculum_index_to_metric[metric], self.curriculum_index_to_sample[metric]
        rows = [np.copy(samples[row]) for row in range(len(samples)) if value_start < values[row][0] <= value_end]
        return np.concatenate(rows, axis=None) if rows else None

    def get_sample_based_on_metric_percentile(self, metric: str, percentile_start: int,
                                              percentile_end: int) -> np.ndarray | None:
        """The samples from percentile ``percentile_start`` to ``percentile_end`` of ``metric``'s order."""
        samples = self.curriculum_index_to_sample[metric]
        if self.data_1epoch_size is None:
            self.data_1epoch_size = sum(len(x) for x in samples)
        top = self.metrics[metric].max_difficulty
        per_percentile = self.data_1epoch_size // top
        start = per_percentile * percentile_start
        end = self.data_1epoch_size if percentile_end == top else per_percentile * percentile_end
        rows, seen = [], 0
        for row in range(len(samples)):
            size = len(samples[row])
            if seen + size > start:
                rows.append(np.copy(samples[row][max(0, start - seen):size if seen + size <= end else end - seen]))
            seen += size
            if seen >= end:
                break
        return np.concatenate(rows, axis=None) if rows else None

    def _within(self, metric: str, low: float, high: int) -> np.ndarray | None:
        if self.difficulty_type[metric] == "value":
            return self.get_sample_based_on_metric_value(metric, low, high)
        return self.get_sample_based_on_metric_percentile(metric, int(low), high)

    def _new_cluster_samples(self, previous: Mapping[str, float]) -> np.ndarray | None:
        clustered = [m for m in self.curriculum_schedulers if self.clustering_type[m] != "single_cluster"]
        everything = np.arange(0, self.one_epoch_total_samples, 1, dtype=self.index_dtype)
        if len(clustered) > 1:  # within every metric's difficulty, less the earlier clusters
            cluster = None
            for metric in self.curriculum_schedulers:
                lowest = float("-inf") if self.difficulty_type[metric] == "value" else 0
                part = everything if metric not in clustered else self._within(
                    metric, lowest, self.current_difficulties[metric])
                cluster = part if cluster is None else np.intersect1d(cluster, part, assume_unique=True)
            for earlier in self.data_clusters:
                cluster = np.setdiff1d(cluster, earlier[0], assume_unique=True)
            return cluster
        cluster = everything if not self.data_clusters else None
        for metric in clustered:
            cluster = self._within(metric, previous[metric], self.current_difficulties[metric])
        return cluster

    def get_new_cluster(self, previous_difficulties: Mapping[str, float]) -> None:
        """Make (rank 0) and record (every rank) the cluster of the difficulties just reached."""
        name = "cluster" + "".join(f"_{m}{self.current_difficulties[m]}" for m in self.curriculum_schedulers)
        made = 0
        if self.global_rank == 0:
            cluster = self._new_cluster_samples(previous_difficulties)
            if cluster is not None and len(cluster) > 0:
                self.np_rng.shuffle(cluster)
                self._write_cluster(name, cluster)
                self.data_clusters.append(MMapIndexedDataset(f"{self.cluster_root}/{name}", skip_warmup=True))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))
                made = 1
        if self._broadcast([made])[0]:
            self.data_cluster_paths.append(name)
            self.data_cluster_current_position.append(0)

    def _write_cluster(self, name: str, cluster: np.ndarray) -> None:
        path = f"{self.cluster_root}/{name}"
        builder = create_mmap_dataset_builder(path, self.index_dtype)
        builder.add_item_numpy(cluster)
        close_mmap_dataset_builder(builder, path)

    def sample_from_clusters(self) -> np.ndarray:
        """How many samples of the next global batch each cluster gives (drawn by cluster size)."""
        if not self.data_clusters:
            bounds = ", ".join(f"{m} {self.current_difficulties[m]}" for m in self.curriculum_schedulers)
            raise UsageError(f"data_efficiency curriculum: no sample qualifies at step {self.curriculum_step} "
                             f"(difficulty {bounds}); raise min_difficulty to include some samples")
        total = sum(self.data_cluster_sizes)
        weights = [size / total for size in self.data_cluster_sizes]
        drawn = self.np_rng.choice(len(self.data_clusters), self.global_batch_size, replace=True, p=weights)
        return np.bincount(drawn, minlength=len(self.data_clusters))

    def reshuffle_clusters(self, cidx: int) -> None:
        """Cluster ``cidx`` in a new order (its file rewritten), once it has been used up."""
        cluster = np.copy(self.data_clusters[cidx][0])
        self.np_rng.shuffle(cluster)
        self._write_cluster(self.data_cluster_paths[cidx], cluster)
        self.data_clusters[cidx] = MMapIndexedDataset(f"{self.cluster_root}/{self.data_cluster_paths[cidx]}", True)

    def get_sample_from_cluster(self, cidx: int, num_samples: int) -> list[Any]:
        """The next ``num_samples`` of cluster ``cidx``'s order (wrapping around into a reshuffle)."""
        start = self.data_cluster_current_position[cidx]
        samples = list(np.copy(self.data_clusters[cidx][0][start:start + num_samples]))
        self.data_cluster_current_position[cidx] += num_samples
        if len(samples) < num_samples:
            remained = num_samples - len(samples)
            self.reshuffle_clusters(cidx)
            samples += list(np.copy(self.data_clusters[cidx][0][:remained]))
            self.data_cluster_current_position[cidx] = remained
        return samples

    # ------------------------------------------------------------------ batches

    def _step_difficulties(self) -> dict[str, float] | None:
        """Move every metric on one step: the previous difficulties if any changed, else None."""
        self.curriculum_step += 1
        changed, previous = False, {}
        for metric, scheduler in self.curriculum_schedulers.items():
            difficulty = scheduler.update_difficulty(self.curriculum_step)
            changed |= self.current_difficulties.get(metric) != difficulty
            lowest = float("-inf") if self.difficulty_type[metric] == "value" else 0
            previous[metric] = self.current_difficulties.get(metric, lowest)
            self.current_difficulties[metric] = difficulty
        return previous if changed else None

    def get_next_global_batch(self) -> None:
        """Draw the next global batch (collective over the data-parallel group)."""
        previous = self._step_difficulties()
        if previous is not None:
            self.get_new_cluster(previous)
        batch = [_NONE] * self.global_batch_size
        if self.global_rank == 0:
            counts = self.sample_from_clusters()
            drawn: list[Any] = []
            for cidx, count in enumerate(counts):
                drawn += self.get_sample_from_cluster(cidx, int(count))
            self.np_rng.shuffle(drawn)
            batch = [int(i) for i in drawn] + [_NONE] * (self.global_batch_size - len(drawn))
        self.batch = [i for i in self._broadcast(batch) if i != _NONE]

    def _broadcast(self, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or self.data_parallel_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.long)
        group_src = dist.get_global_rank(self.data_parallel_group, 0) if self.data_parallel_group is not None else 0
        dist.broadcast(tensor, group_src, group=self.data_parallel_group)
        return tensor.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_times_data_parallel_size
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current, self.batch = self.batch[:step], self.batch[step:]
            if len(current) == step or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                self.consumed_samples += len(current)  # before the yield: a state taken now is past it
                yield current[start:end]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The position (DeepSpeed's keys); ``np_rng_state`` is this sampler's generator."""
        return {"batch": list(self.batch), "consumed_samples": self.consumed_samples,
                "curriculum_step": self.curriculum_step, "current_difficulties": dict(self.current_difficulties),
                "data_cluster_paths": list(self.data_cluster_paths),
                "data_cluster_current_position": list(self.data_cluster_current_position),
                "np_rng_state": copy.deepcopy(self.np_rng.bit_generator.state),
                "scheduler_difficulties": {m: s.get_current_difficulty() for m, s in self.curriculum_schedulers.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at a saved position (this sampler's or DeepSpeed's ``state_dict``); rank 0 re-opens
        the cluster files under the configured ``data_cluster_path``.

        Raises:
            DatasetFormatError: a cluster file is missing or unreadable (rank 0).
        """
        self.batch = list(state_dict["batch"])
        self.consumed_samples = int(state_dict["consumed_samples"])
        self.curriculum_step = int(state_dict["curriculum_step"])
        self.current_difficulties = dict(state_dict["current_difficulties"])
        # DeepSpeed once saved absolute paths: the file name under the configured directory counts
        self.data_cluster_paths = [p.rsplit("/", 1)[-1] for p in state_dict["data_cluster_paths"]]
        self.data_cluster_current_position = list(state_dict["data_cluster_current_position"])
        rng = state_dict.get("sampler_rng_state", state_dict["np_rng_state"])  # the former: DeepSpeed's format
        if isinstance(rng, Mapping):
            self.np_rng.bit_generator.state = copy.deepcopy(dict(rng))
        else:  # DeepSpeed's checkpoint: numpy's global state, restored as DeepSpeed does
            np.random.set_state(rng)
        # DeepSpeed's schedulers are not in its state: they restart, and catch up at the next step
        for metric, difficulty in state_dict.get("scheduler_difficulties", {}).items():
            self.curriculum_schedulers[metric].set_current_difficulty(difficulty)
        if self.global_rank == 0:
            self.data_clusters = [MMapIndexedDataset(f"{self.cluster_root}/{p}", True) for p in self.data_cluster_paths]
            self.data_cluster_sizes = [len(c[0]) for c in self.data_clusters]
