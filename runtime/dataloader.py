"""The distributed training data loader returned by ``initialize(training_data=...)``.

Owns which samples each rank sees in each epoch and the exact position inside an epoch, so that
a resumed run sees exactly the batches the uninterrupted run would have seen.

Order: each epoch is one permutation of the dataset, ``torch.randperm(len, seed + epoch)``
(``arange`` without shuffle) -- the same permutation and the same rank interleaving as torch's
``DistributedSampler``, which DeepSpeed's loader uses. Step k of an epoch takes the next
``world_size * batch_size`` entries of the permutation; rank r gets every ``world_size``-th of
them starting at r (with ``blocked``, the ``layout_invariant`` order: the r-th run of
``batch_size`` of them, so that a rank's batch is the same piece of the permutation at any world
size: micro batch ``k * world_size + r`` of the epoch). So in one epoch:

- ``drop_last=True``: the permutation is cut to a multiple of ``world_size * batch_size``; every
  kept sample is seen exactly once, on exactly one rank, all batches full.
- ``drop_last=False``: the permutation is padded by wrapping around to a multiple of
  ``world_size`` (as ``DistributedSampler`` does); every sample is seen at least once, the last
  batch of each rank may be short, every rank has the same number of batches (so no rank waits
  in a collective for a batch that never comes).

Position: ``state_dict()`` = (epoch, permutation entries consumed). Because the position is a
global offset, a run may resume with another world size or batch size; the rest of the epoch is
then split among the new ranks. With ``drop_last=False`` the rest is padded (wrapping around to
the epoch's first samples) to a multiple of the new world size, so no rank ever gets an empty
batch; a few samples may then be seen twice in that epoch. With ``drop_last=True`` the rest is
cut to whole steps of the new world and batch size.

Epochs advance by themselves when one is exhausted (DeepSpeed's loader never calls
``set_epoch``, so it repeats the same order every epoch); ``set_epoch(e)`` jumps to the start of
epoch ``e`` unless the loader is already in epoch ``e`` (a resumed run calling ``set_epoch`` for
the epoch it resumed in keeps its position).

Samples are fetched by a torch ``DataLoader`` driven by this loader's batches, so
``num_workers`` and ``pin_memory`` behave as in torch; workers' prefetching does not move the
position, which counts batches handed to the caller. That ``DataLoader`` gets its own generator
seeded with ``seed + epoch`` (it draws the workers' base seed from it): iterating never touches
the global torch RNG, so the training script's random stream is the same whether or not, and
however often, it starts iterating (bitwise resume does not depend on the loop structure).

``DeepSpeedDataLoader`` is the class ``initialize(training_data=...)`` and ``deepspeed_io`` return,
under DeepSpeed's name and with its constructor (scripts annotate with it; some build one).

Limitations: map-style datasets (``__len__`` and ``__getitem__``); one active iterator at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dslaunch.errors import CheckpointError, NotInDslaunchError

__all__ = ["DistributedDataLoader", "DeepSpeedDataLoader", "RepeatingLoader"]


class DistributedDataLoader:
    """Deterministic, resumable, rank-sharded batches over a map-style dataset.

    Args:
        dataset: anything with ``__len__`` and ``__getitem__(int)`` (e.g. a torch ``Dataset``).
        batch_size: samples per batch on this rank (``train_micro_batch_size_per_gpu``).
        rank, world_size: this rank's data-parallel index and the number of data-parallel ranks.
        collate_fn: turns a list of samples into a batch (default: torch's ``default_collate``).
        shuffle: a new permutation every epoch (else dataset order).
        seed: base seed; epoch e uses ``seed + e`` on every rank.
        drop_last: see the module docstring.
        num_workers, pin_memory: passed to the torch ``DataLoader`` that fetches the samples.
        blocked: each step's entries split into runs of ``batch_size``, one per rank, instead of
            interleaved (see the module docstring).

    Raises:
        ValueError: non-positive batch size or world size, rank outside [0, world_size).
        TypeError: ``dataset`` is not map-style (e.g. a torch ``IterableDataset``).
    """

    def __init__(self, dataset: Any, batch_size: int, rank: int, world_size: int,
                 collate_fn: Callable[[list[Any]], Any] | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, num_workers: int = 0, pin_memory: bool = False, blocked: bool = False):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size >= 1, world_size >= 1 and 0 <= rank < world_size; got "
                             f"batch_size={batch_size}, rank={rank}, world_size={world_size}")
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"training_data must be a map-style dataset (with __len__ and __getitem__) so "
                            f"that it can be shuffled and split across ranks; got {type(dataset).__name__}. "
                            "For an iterable dataset, build the loader yourself and pass batches to the engine")
        if collate_fn is None:
            from torch.utils.data import default_collate as collate_fn
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.blocked = blocked
        self.epoch = 0
        self._offset = 0  # permutation entries of this epoch already handed out (all ranks)

    # ------------------------------------------------------------------ order

    def _permutation(self, epoch: int) -> list[int]:
        import torch

        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=generator).tolist()

    def _remaining(self) -> list[int]:
        """The rest of this epoch's permutation, cut or padded as ``drop_last`` says."""
        order = self._permutation(self.epoch)
        if self.drop_last:
            rest = order[self._offset:]
            step = self.world_size * self.batch_size
            return rest[:len(rest) - len(rest) % step]
        # Pad the rest to a multiple of world_size by wrapping around to the epoch's start, so the
        # last chunk gives every rank at least one sample. An uninterrupted run, or one resumed at
        # the same world size, is at an offset that is a multiple of world_size: it pads with the
        # same samples as padding the whole epoch (DistributedSampler's padding).
        rest = order[self._offset:]
        padding = -len(rest) % self.world_size
        while padding > 0 and order:  # wrap around, repeatedly if the dataset is tiny
            extra = order[:padding]
            rest, padding = rest + extra, padding - len(extra)
        return rest

    def __len__(self) -> int:
        """Batches per (full) epoch on this rank."""
        n = len(self.dataset)
        if self.drop_last:
            return n // (self.world_size * self.batch_size)
        return math.ceil(math.ceil(n / self.world_size) / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        """Batches from the current position to the end of the current epoch."""
        order = self._remaining()
        step = self.world_size * self.batch_size
        chunks = [order[i:i + step] for i in range(0, len(order), step)]
        if not chunks:
            self._next_epoch()
            return
        for k, batch in enumerate(self._fetch([self._share(chunk) for chunk in chunks])):
            # Advance before yielding: a state_dict() taken while the caller holds this batch
            # already points at the next one (the last batch moves to the next epoch).
            if k == len(chunks) - 1:
                self._next_epoch()
            else:
                self._offset += len(chunks[k])
            yield batch

    def _share(self, chunk: list[int]) -> list[int]:
        """This rank's entries of one step's ``chunk`` (a short last chunk: an even split)."""
        if not self.blocked:
            return chunk[self.rank::self.world_size]
        run = math.ceil(len(chunk) / self.world_size)
        return chunk[self.rank * run:(self.rank + 1) * run]

    def _fetch(self, batches: list[list[int]]) -> Iterator[Any]:
        import torch
        from torch.utils.data import DataLoader

        # Without a generator, each DataLoader iterator draws a seed from the global RNG.
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return iter(DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                               num_workers=self.num_workers, pin_memory=self.pin_memory,
                               generator=generator))

    def _next_epoch(self) -> None:
        self.epoch += 1
        self._offset = 0

    @property
    def data_sampler(self) -> DistributedDataLoader:
        """DeepSpeed scripts call ``loader.data_sampler.set_epoch(e)``; the loader is its own sampler."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (no-op if already in that epoch)."""
        if epoch != self.epoch:
            self.epoch, self._offset = int(epoch), 0

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The exact position: the next batch this loader will produce."""
        return {"epoch": self.epoch, "offset": self._offset, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_len": len(self.dataset), "world_size": self.world_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position (world size and batch size may differ from the saved run).

        Raises:
            CheckpointError: the saved position belongs to another dataset length, seed or
                shuffle setting, so it would not mean the same samples.
        """
        for key in ("dataset_len", "seed", "shuffle"):
            mine = len(self.dataset) if key == "dataset_len" else getattr(self, key)
            if key in state and state[key] != mine:
                raise CheckpointError(f"the saved data loader position was taken with {key}={state[key]!r} but "
                                      f"this run has {key}={mine!r}; the same position would mean other samples")
        self.epoch = int(state["epoch"])
        self._offset = int(state["offset"])


class DeepSpeedDataLoader(DistributedDataLoader):
    """DeepSpeed's ``DeepSpeedDataLoader``: its constructor, this module's loader.

    Without ``data_sampler`` it is ``DistributedDataLoader`` over the data-parallel group
    (``data_parallel_world_size``/``data_parallel_rank``, default torch.distributed's world, else
    one rank), which shuffles as DeepSpeed's ``DistributedSampler`` does and also resumes exactly.
    With one, torch's ``DataLoader`` over that sampler, as DeepSpeed's (its position is the
    sampler's: ``state_dict`` then refuses). ``local_rank`` and ``tput_timer`` are accepted and not
    used (the engine times its own steps); ``num_local_io_workers`` defaults to 0 worker processes,
    not DeepSpeed's two per device.

    With ``deepspeed_dataloader_config={"curriculum_learning": True, "data_efficiency": ...}`` (what
    DeepSpeed's engine passes when data sampling by curriculum is on) the object made is a
    ``CurriculumDataLoader`` (``runtime/data_pipeline/data_sampling/curriculum_loader.py``).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        settings = kwargs.get("deepspeed_dataloader_config") or (args[11] if len(args) > 11 else None)
        if cls is DeepSpeedDataLoader and (settings or {}).get("curriculum_learning"):
            from dslaunch.runtime.data_pipeline.data_sampling.curriculum_loader import CurriculumDataLoader

            return CurriculumDataLoader(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, dataset: Any, batch_size: int, pin_memory: bool, local_rank: int, tput_timer: Any,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_local_io_workers: int | None = None,
                 data_sampler: Any = None, data_parallel_world_size: int | None = None,
                 data_parallel_rank: int | None = None, dataloader_drop_last: bool = False,
                 deepspeed_dataloader_config: Mapping[str, Any] | None = None, *, shuffle: bool = True,
                 blocked: bool = False):
        del local_rank, tput_timer, deepspeed_dataloader_config
        import torch.distributed as dist

        joined = dist.is_available() and dist.is_initialized()
        world = data_parallel_world_size or (dist.get_world_size() if joined else 1)
        rank = data_parallel_rank if data_parallel_rank is not None else (dist.get_rank() if joined else 0)
        super().__init__(dataset, batch_size, rank, world, collate_fn=collate_fn, shuffle=shuffle,
                         drop_last=dataloader_drop_last, num_workers=num_local_io_workers or 0,
                         pin_memory=pin_memory, blocked=blocked)
        self._sampler = data_sampler

    @property
    def data_sampler(self) -> Any:
        return self if self._sampler is None else self._sampler

    def _sampled(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=self._sampler,
                          collate_fn=self.collate_fn, num_workers=self.num_workers, pin_memory=self.pin_memory,
                          drop_last=self.drop_last)

    def __len__(self) -> int:
        return super().__len__() if self._sampler is None else len(self._sampled())

    def __iter__(self) -> Iterator[Any]:
        return super().__iter__() if self._sampler is None else iter(self._sampled())

    def state_dict(self) -> dict[str, Any]:
        if self._sampler is not None:
            raise NotInDslaunchError("DeepSpeedDataLoader.state_dict() with a data_sampler: the position is the "
                                     "sampler's; save the sampler's own state")
        return super().state_dict()


class RepeatingLoader:
    """Iterate ``loader`` forever, restarting it when exhausted (DeepSpeed's
    ``deepspeed.runtime.dataloader.RepeatingLoader``; the pipeline engine's ``train_batch`` pulls
    micro batches from one)."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
