"""The training loader ``deepspeed_io`` returns when ``data_efficiency`` samples by curriculum:
DeepSpeed's ``DeepSpeedDataLoader`` over a ``DeepSpeedDataSampler`` (the sampler picks each
micro batch's indices, a torch ``DataLoader`` fetches and collates them).

The loader is its own iterator, as DeepSpeed's: ``iter(loader)`` starts fetching from the
sampler's position and ``next(loader)`` hands out the next micro batch, passed first through the
function ``engine.set_data_post_process_func`` installed (``fn(batch, sampler_state)``).

Position: the sampler's state as of the batch last handed out. Each batch's indices are paired
with the sampler's state right after they were drawn, so ``state_dict()`` is exact even when
worker processes prefetch batches ahead (DeepSpeed saves the sampler's live state, which is ahead
by what was prefetched); the engine's checkpoint saves it, and ``load_state_dict`` drops any
prefetched batch and resumes right after the saved one.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dslaunch.errors import UsageError
from dslaunch.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

__all__ = ["CurriculumDataLoader", "curriculum_loader_config"]


def curriculum_loader_config(data_efficiency: Any, group: Any, gradient_accumulation_steps: int, global_rank: int,
                             num_workers: int) -> dict[str, Any]:
    """The ``deepspeed_dataloader_config`` DeepSpeed's engine hands its loader (its keys)."""
    return {"curriculum_learning": True, "data_efficiency": data_efficiency, "data_parallel_group": group,
            "gradient_accumulation_steps": gradient_accumulation_steps, "global_rank": global_rank,
            "num_workers": num_workers}


class _Snapshots:
    """A batch sampler over ``sampler`` that records the sampler's state after each batch."""

    def __init__(self, sampler: DeepSpeedDataSampler, states: deque):
        self.sampler, self.states = sampler, states

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.sampler:
            self.states.append(self.sampler.state_dict())
            yield indices

    def __len__(self) -> int:
        return len(self.sampler)


class CurriculumDataLoader:
    """DeepSpeed's loader with ``deepspeed_dataloader_config={"curriculum_learning": True, ...}``.

    Args: as ``DeepSpeedDataLoader``'s; ``deepspeed_dataloader_config`` holds ``data_efficiency``
    (the block), ``data_parallel_group``, ``gradient_accumulation_steps``, ``global_rank`` and
    ``num_workers``. ``data_sampler``, ``local_rank`` and ``tput_timer`` are not used.

    Raises:
        ConfigError: a bad ``data_efficiency`` block.
        UsageError: no ``data_efficiency`` in ``deepspeed_dataloader_config``.
    """

    def __init__(self, dataset: Any, batch_size: int, pin_memory: bool, local_rank: int, tput_timer: Any,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_local_io_workers: int | None = None,
                 data_sampler: Any = None, data_parallel_world_size: int | None = None,
                 data_parallel_rank: int | None = None, dataloader_drop_last: bool = False,
                 deepspeed_dataloader_config: Mapping[str, Any] | None = None, **_: Any):
        del local_rank, tput_timer, data_sampler, num_local_io_workers
        import torch.distributed as dist

        settings = dict(deepspeed_dataloader_config or {})
        if settings.get("data_efficiency") is None:
            raise UsageError("DeepSpeedDataLoader(deepspeed_dataloader_config={'curriculum_learning': True, ...}) "
                             "needs the ds_config's block there as 'data_efficiency' (what the engine's deepspeed_io "
                             "passes); or leave curriculum_learning out")
        joined = dist.is_available() and dist.is_initialized()
        world = data_parallel_world_size or (dist.get_world_size() if joined else 1)
        rank = data_parallel_rank if data_parallel_rank is not None else (dist.get_rank() if joined else 0)
        global_rank = settings.get("global_rank", dist.get_rank() if joined else 0)
        self.data_sampler = DeepSpeedDataSampler(
            settings["data_efficiency"], len(dataset), batch_size, rank, world, settings.get("data_parallel_group"),
            settings.get("gradient_accumulation_steps", 1), global_rank, drop_last=dataloader_drop_last)
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.num_local_io_workers = int(settings.get("num_workers", 0))
        self.pin_memory = pin_memory
        self.curriculum_learning_enabled = True
        self.post_process_func: Callable[[Any, dict], Any] | None = None
        self._states: deque = deque()
        self._iterator: Iterator[Any] | None = None
        self._position = self.data_sampler.state_dict()

    def __len__(self) -> int:
        return len(self.data_sampler) // self.batch_size

    def __iter__(self) -> CurriculumDataLoader:
        from torch.utils.data import DataLoader

        self._states.clear()
        self.data_sampler.load_state_dict(self._position)  # undo what an earlier iterator drew ahead
        kwargs = {} if self.collate_fn is None else {"collate_fn": self.collate_fn}
        self.dataloader = DataLoader(self.dataset, batch_sampler=_Snapshots(self.data_sampler, self._states),
                                     num_workers=self.num_local_io_workers, pin_memory=self.pin_memory, **kwargs)
        self._iterator = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self.__iter__()
        data = next(self._iterator)
        self._position = self._states.popleft()
        if self.post_process_func is not None:
            data = self.post_process_func(data, copy.deepcopy(self._position))
        return data

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state as of the last batch handed out."""
        return copy.deepcopy(self._position)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume right after the batch ``state`` was taken at (prefetched batches are dropped).

        Raises:
            DatasetFormatError: a cluster file named in ``state`` is missing (rank 0).
        """
        self._position = copy.deepcopy(dict(state))
        self.data_sampler.load_state_dict(self._position)
        self._iterator = None
