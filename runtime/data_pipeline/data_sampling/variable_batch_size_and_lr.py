"""``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr``: DeepSpeed's
batching by a token budget and the LR scaled to each batch's size.

``batch_by_seqlens`` packs samples, in the order ``sequence_picking_order`` says (the dataset's,
``random`` with ``seed``, or by length), into micro batches of at most ``max_tokens`` tokens
(``min_batch_size``/``max_batch_size`` samples), greedily, and groups ``effective_batch_size``
micro batches into a batch; ``dataloader_for_variable_batch_size`` deals the micro batches out to
the data-parallel ranks; ``VariableBatchSizeLR`` sets the LR of each step to the base scheduler's
LR scaled by the batch's sample count over ``base_batch_size`` (``linear``, ``sqrt`` or ``none``).
``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, ...)`` reads
``data_efficiency.data_sampling.dynamic_batching`` and the lengths (given, or the analyzer's
``seqlen`` files under ``metrics_path``, made first with ``batch_seqlens_fn`` when missing).
The batches and LRs are DeepSpeed's for the same input (a test compares them).

Differences from DeepSpeed: the packing is linear in the dataset (DeepSpeed tries every batch end
for every batch: quadratic); too few samples for one batch, or lengths that do not match the
dataset, are a ``UsageError`` (DeepSpeed asserts); missing seqlen files are made by
``DataAnalyzer.run_map_reduce`` over the engine's ranks (DeepSpeed's ``DistributedDataAnalyzer``,
not in dslaunch); the scheduler's construction does not repeat torch's warnings about calling
``get_lr``/``step(0)`` itself. As DeepSpeed's, the last sample in picking order is never used.
"""

from __future__ import annotations

import math
import os
import random
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, DistributedSampler

from dslaunch.errors import ConfigError, UsageError
from dslaunch.utils.logging import logger

__all__ = ["batch_by_seqlens", "scale_lr", "dataloader_for_variable_batch_size", "VariableBatchSizeLR",
           "lr_scheduler_for_variable_batch_size", "get_dataloader_and_lr_scheduler_for_variable_batch_size",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"]


def _valid(micro: Sequence[tuple], min_batch_size: int, max_batch_size: int | None, max_tokens: int) -> str:
    """'ok', 'few' (can grow into valid) or 'over' (stays invalid as it grows)."""
    if max_batch_size and len(micro) > max_batch_size or sum(m[0] for m in micro) > max_tokens:
        return "over"
    return "few" if min_batch_size and len(micro) < min_batch_size else "ok"


def _pack(metrics: list[tuple], max_tokens: int, min_batch_size: int, max_batch_size: int | None,
          multiple: int) -> list[list[tuple]]:
    micro: list[list[tuple]] = []
    start = 0
    while start < len(metrics):
        end = start  # the largest valid end, as DeepSpeed's scan over every end (never len(metrics))
        for candidate in range(start + multiple, len(metrics), multiple):
            part = metrics[start:candidate]
            verdicts = [_valid(part[b::multiple], min_batch_size, max_batch_size, max_tokens) for b in range(multiple)]
            if "over" in verdicts:
                break  # sizes and sums only grow with the end
            if all(v == "ok" for v in verdicts):
                end = candidate
        if end == start:
            break
        part = metrics[start:end]
        parts = [part[b::multiple] for b in range(multiple)]
        start += sum(len(p) for p in parts)
        micro += parts
    return micro


def batch_by_seqlens(seqlens: Sequence[int], max_tokens: int, sequence_ids_per_mb: Sequence[int] | None = None,
                     min_batch_size: int = 1, max_batch_size: int | None = None,
                     sequence_picking_order: str = "dataloader", effective_batch_size: int = 1,
                     required_microbatches_of_same_size: bool = False, verbose: bool = False,
                     seed: int | None = None) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
    """Micro batches of at most ``max_tokens`` tokens, ``effective_batch_size`` per batch.

    Returns:
        ``[(batch id, sample ids)]`` per micro batch, each batch's sample count, each batch's
        longest sample.

    Raises:
        UsageError: an unknown picking order, or too few samples for one batch.
    """
    if sequence_picking_order not in ("random", "seqlen", "dataloader"):
        raise UsageError(f"sequence_picking_order {sequence_picking_order!r}: use dataloader, random or seqlen")
    ids = list(range(len(seqlens))) if sequence_ids_per_mb is None else list(sequence_ids_per_mb)
    values = np.asarray(seqlens)[ids] if sequence_ids_per_mb is not None else seqlens
    metrics = list(zip(values, ids, strict=True))
    if sequence_picking_order == "random":
        random.Random(seed).shuffle(metrics)
    elif sequence_picking_order == "seqlen":
        metrics = sorted(metrics)
    too_long = {idx for value, idx in metrics if value > max_tokens}
    if too_long:
        logger.warning(f"Data indices {sorted(too_long)} ignored as metrics exceed {max_tokens}.")
        metrics = [m for m in metrics if m[1] not in too_long]
    multiple = effective_batch_size if required_microbatches_of_same_size else 1
    micro = _pack(metrics, max_tokens, min_batch_size, max_batch_size, multiple)
    if len(micro) < effective_batch_size:
        raise UsageError(f"dynamic batching: {len(micro)} micro batch(es) of at most {max_tokens} tokens from "
                         f"{len(metrics)} samples, fewer than the {effective_batch_size} of one batch")
    micro = micro[:len(micro) - len(micro) % effective_batch_size]
    ids_out: list[tuple[int, list[int]]] = []
    sizes, longest = [], []
    for first in range(0, len(micro), effective_batch_size):
        batch = micro[first:first + effective_batch_size]
        sizes.append(sum(len(mb) for mb in batch))
        longest.append(max(max(m[0] for m in mb) for mb in batch))
        ids_out += [(first // effective_batch_size, [m[1] for m in mb]) for mb in batch]
        if verbose:
            logger.info(f"Batch id {first // effective_batch_size}: sequences per micro batch "
                        f"{[len(mb) for mb in batch]}, tokens {[sum(m[0] for m in mb) for mb in batch]}")
    return ids_out, sizes, longest


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float = 1, method: str | None = "linear") -> float:
    """``base_lr`` for ``batch_size`` samples, given it suits ``base_batch_size``.

    Raises:
        ValueError: an unknown method.
    """
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or method.upper() == "NONE":
        return base_lr
    raise ValueError(f"Unknown scaling method: {method} (use linear, sqrt or none)")


def dataloader_for_variable_batch_size(dataset: Any, microbatch_ids: list, batch_max_seqlens: list[int],
                                       dataloader_rank: int = 0, dataloader_batch_size: int = 1,
                                       dataloader_num_replicas: int = 1, dataloader_collate_fn: Callable | None = None,
                                       dataloader_num_workers: int = 2, dataloader_pin_memory: bool = False,
                                       required_microbatches_of_same_seqlen: bool = False,
                                       sample_padding_fn: Callable | None = None) -> tuple[DataLoader, dict]:
    """This rank's micro batches (every ``dataloader_num_replicas``-th, from ``dataloader_rank``) and
    the keyword arguments of the same loader for ``engine.deepspeed_io``.

    Raises:
        UsageError: same-length micro batches asked for without ``sample_padding_fn``.
    """
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise UsageError("dynamic batching with micro batches of the same length (the pipeline engine) needs "
                         "sample_padding_fn(sample, length)")
    sampler = DistributedSampler(microbatch_ids, num_replicas=dataloader_num_replicas, rank=dataloader_rank,
                                 shuffle=False, drop_last=False)

    def collate(picked: list[tuple[int, list[int]]]) -> Any:
        batch = []
        for batch_id, ids in picked:
            samples = [dataset[i] for i in ids]
            if required_microbatches_of_same_seqlen:
                samples = [sample_padding_fn(s, batch_max_seqlens[batch_id]) for s in samples]
            batch += samples
        return dataloader_collate_fn(batch) if dataloader_collate_fn else batch

    loader = DataLoader(microbatch_ids, batch_size=dataloader_batch_size, sampler=sampler,
                        num_workers=dataloader_num_workers, collate_fn=collate, pin_memory=dataloader_pin_memory)
    kwargs = {"dataset": microbatch_ids, "batch_size": dataloader_batch_size, "pin_memory": dataloader_pin_memory,
              "data_sampler": sampler, "collate_fn": collate, "num_local_io_workers": dataloader_num_workers}
    return loader, kwargs


class VariableBatchSizeLR(LRScheduler):
    """A scheduler's LR scaled at each step to that step's batch size (DeepSpeed's arguments).

    ``step()`` moves the base scheduler on, then scales its LR by batch ``last_epoch``'s size.
    """

    @property
    def optimizer(self) -> Any:
        return self.base_lr_scheduler.optimizer

    def __init__(self, lr_scheduler: Any, base_batch_size: int, batch_sizes: list[int], dataloader: Any,
                 lr_scaling_method: str = "linear", last_epoch: int = -1, verbose: bool = False):
        # no LRScheduler.__init__: the base scheduler owns the optimizer's LRs (as DeepSpeed's)
        self.batch_sizes, self.base_batch_size = batch_sizes, base_batch_size
        self.lr_scaling_method, self.dataloader = lr_scaling_method, dataloader
        self.base_lr_scheduler = lr_scheduler
        self.last_epoch, self.verbose = last_epoch, verbose
        with warnings.catch_warnings():  # torch's warnings about calling get_lr/step(epoch) directly
            warnings.simplefilter("ignore", UserWarning)
            self.base_lrs = self.base_lr_scheduler.get_lr()
            self.step(0)  # the first batch's LR

    def state_dict(self) -> dict[str, Any]:
        return {"base_lr_scheduler": self.base_lr_scheduler.state_dict(), "base_batch_size": self.base_batch_size,
                "lr_scaling_method": self.lr_scaling_method, "batch_sizes": self.batch_sizes,
                "base_lrs": self.base_lrs, "last_epoch": self.last_epoch, "verbose": self.verbose}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        for key in ("base_batch_size", "lr_scaling_method", "batch_sizes", "base_lrs", "last_epoch", "verbose"):
            setattr(self, key, state_dict[key])

    def get_last_lr(self) -> list[float]:
        return self.base_lr_scheduler._last_lr

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.base_lr_scheduler.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        groups = self.base_lr_scheduler.optimizer.param_groups
        unscaled = self.base_lrs if epoch == 0 else self.get_last_lr()
        for group, lr in zip(groups, unscaled, strict=False):
            group["lr"] = lr  # the base scheduler steps from its own, unscaled LR
        self.base_lr_scheduler.step(epoch)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        batch_size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for group in groups:
            group["lr"] = scale_lr(self.base_batch_size, batch_size, group["lr"], self.lr_scaling_method)
        if self.verbose:
            logger.info(f"batch {self.last_epoch}: {batch_size} samples (reference {self.base_batch_size}), "
                        f"lr {unscaled} -> {self.get_lr()}")


class _ConstantLR(LRScheduler):
    """The optimizer's LRs, unchanged (the base when there is no LR scheduler)."""

    def get_lr(self) -> list[float]:
        return self.base_lrs


def lr_scheduler_for_variable_batch_size(base_batch_size: int, batch_sizes: list[int], dataloader: Any,
                                         lr_scheduler_or_optimizer: Any, lr_scaling_method: str = "linear",
                                         verbose: bool = False) -> VariableBatchSizeLR:
    """``VariableBatchSizeLR`` over a scheduler, or over an optimizer's constant LRs.

    Raises:
        ValueError: neither a torch optimizer nor something with a torch ``optimizer``.
    """
    if isinstance(lr_scheduler_or_optimizer, Optimizer):
        base = _ConstantLR(lr_scheduler_or_optimizer)
    elif isinstance(getattr(lr_scheduler_or_optimizer, "optimizer", None), Optimizer):
        base = lr_scheduler_or_optimizer
    else:
        raise ValueError(f"Unknown type for lr_scheduler_or_optimizer: {type(lr_scheduler_or_optimizer)} "
                         "(give a torch optimizer or an LR scheduler of one)")
    return VariableBatchSizeLR(base, base_batch_size, batch_sizes, dataloader, lr_scaling_method, verbose=verbose)


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset: Any, dataset_seqlens: Sequence[int], max_tokens: int, effective_batch_size: int,
        dataset_filter_ids: Sequence[int] | None = None, lr_scaling_method: str = "linear", min_batch_size: int = 1,
        max_batch_size: int | None = None, sequence_picking_order: str = "dataloader", dataloader_batch_size: int = 1,
        dataloader_rank: int = 0, dataloader_num_replicas: int = 1, dataloader_num_workers: int = 0,
        dataloader_collate_fn: Callable | None = None, dataloader_pin_memory: bool = False,
        lr_scheduler_or_optimizer: Any = None, required_microbatches_of_same_size: bool = False,
        required_microbatches_of_same_seqlen: bool = False, sample_padding_fn: Callable | None = None,
        verbose: bool = False, seed: int | None = None) -> tuple[DataLoader, VariableBatchSizeLR, dict]:
    """The loader, the LR scheduler and ``deepspeed_io``'s keyword arguments (see ``batch_by_seqlens``).

    Raises:
        UsageError, ValueError: as ``batch_by_seqlens`` and ``lr_scheduler_for_variable_batch_size``.
    """
    micro, sizes, longest = batch_by_seqlens(dataset_seqlens, max_tokens, dataset_filter_ids, min_batch_size,
                                             max_batch_size, sequence_picking_order, effective_batch_size,
                                             required_microbatches_of_same_size, verbose, seed)
    loader, kwargs = dataloader_for_variable_batch_size(
        dataset, micro, longest, dataloader_rank, dataloader_batch_size, dataloader_num_replicas,
        dataloader_collate_fn, dataloader_num_workers, dataloader_pin_memory, required_microbatches_of_same_seqlen,
        sample_padding_fn)
    scheduler = lr_scheduler_for_variable_batch_size(effective_batch_size, sizes, loader, lr_scheduler_or_optimizer,
                                                     lr_scaling_method, verbose)
    return loader, scheduler, kwargs


def _seqlens(dataset: Any, engine: Any, metrics_path: str | None, collate: Callable | None,
             batch_seqlens_fn: Callable | None) -> np.ndarray:
    import torch

    from dslaunch.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
    from dslaunch.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    if metrics_path is None:
        raise ConfigError("is required without dataset_seqlens (where the analyzer's seqlen files are or go)",
                          key="data_efficiency.data_sampling.dynamic_batching.metrics_path")
    prefix = os.path.join(metrics_path, "seqlen/seqlen_sample_to_metric")
    if not MMapIndexedDataset.exists(prefix):
        if batch_seqlens_fn is None:
            raise UsageError(f"dynamic batching: no {prefix}.idx/.bin; pass dataset_seqlens, or batch_seqlens_fn to "
                             "make them")
        DataAnalyzer(dataset, num_workers=engine.world_size, worker_id=engine.global_rank, batch_size=2**10,
                     metric_names=["seqlen"], metric_functions=[lambda b: torch.as_tensor(batch_seqlens_fn(b)).long()],
                     metric_types=["single_value_per_sample"], metric_dtypes=[torch.long], save_path=metrics_path,
                     collate_fn=collate).run_map_reduce()
    lengths = MMapIndexedDataset(prefix, skip_warmup=True)
    if len(lengths) != len(dataset):
        raise UsageError(f"{prefix}: {len(lengths)} lengths for a dataset of {len(dataset)} samples; delete "
                         f"{metrics_path} if the dataset changed")
    return np.array(list(lengths), dtype=np.int64).flatten()


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset: Any, engine: Any, dataset_seqlens: Sequence[int] | None = None,
        dataset_filter_ids: Sequence[int] | None = None, dataloader_collate_fn: Callable | None = None,
        sample_padding_fn: Callable | None = None,
        batch_seqlens_fn: Callable | None = None) -> tuple[DataLoader, VariableBatchSizeLR, dict]:
    """The above for an engine whose ds_config has ``data_sampling.dynamic_batching`` on.

    Raises:
        ConfigError: dynamic batching is off, or ``metrics_path`` is needed and missing.
        UsageError: no lengths to be had, or lengths of another dataset.
    """
    from dslaunch.runtime.pipe.engine import PipelineEngine

    settings = engine._config.data_efficiency
    batching = settings.data_sampling.dynamic_batching
    if not batching.enabled:
        raise ConfigError("must be true to batch by tokens", key="data_efficiency.data_sampling.dynamic_batching.enabled")
    if dataset_seqlens is None:
        dataset_seqlens = _seqlens(dataset, engine, batching.metrics_path, dataloader_collate_fn, batch_seqlens_fn)
    pipelined = isinstance(engine, PipelineEngine)
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset, dataset_seqlens, batching.max_tokens, engine.train_batch_size(), dataset_filter_ids,
        batching.lr_scaling_method, batching.min_batch_size, batching.max_batch_size, batching.sequence_picking_order,
        engine.train_micro_batch_size_per_gpu(), engine.grid.get_data_parallel_rank(),
        engine.grid.get_data_parallel_world_size(), settings.data_sampling.num_workers, dataloader_collate_fn,
        settings.data_sampling.pin_memory, engine.lr_scheduler or engine.basic_optimizer, pipelined, pipelined,
        sample_padding_fn, batching.verbose, settings.seed)
