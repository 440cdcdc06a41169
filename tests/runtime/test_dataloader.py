"""DistributedDataLoader: sharding, determinism, drop_last, exact resume, collate, DistributedSampler parity;
DeepSpeedDataLoader: DeepSpeed's name and constructor for it."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dslaunch.errors import CheckpointError, NotInDslaunchError, UsageError
from dslaunch.runtime.dataloader import DeepSpeedDataLoader, DistributedDataLoader

pytestmark = pytest.mark.timeout(60)


class Squares(Dataset):
    """A map-style torch Dataset: sample i is (i, i*i)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.tensor(i * i)


def _ids(batch) -> list[int]:
    return batch[0].tolist()


def _loaders(n: int, world: int, batch: int, **kw) -> list[DistributedDataLoader]:
    return [DistributedDataLoader(Squares(n), batch, rank, world, **kw) for rank in range(world)]


def _epoch(loader: DistributedDataLoader) -> list[list[int]]:
    return [_ids(b) for b in loader]


@pytest.mark.parametrize("n, world, batch", [(40, 4, 2), (43, 4, 3), (10, 3, 4), (7, 2, 1)])
def test_drop_last_every_kept_sample_once_across_ranks(n: int, world: int, batch: int) -> None:
    loaders = _loaders(n, world, batch, drop_last=True)
    per_rank = [_epoch(loader) for loader in loaders]
    assert all(len(batches) == len(loaders[0]) == n // (world * batch) for batches in per_rank)
    assert all(len(b) == batch for batches in per_rank for b in batches)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen)) == (n // (world * batch)) * world * batch


@pytest.mark.parametrize("n, world, batch", [(43, 4, 3), (10, 3, 4), (5, 4, 2), (2, 3, 1)])
def test_no_drop_last_covers_everything_with_equal_batch_counts(n: int, world: int, batch: int) -> None:
    loaders = _loaders(n, world, batch, drop_last=False)
    per_rank = [_epoch(loader) for loader in loaders]
    assert all(len(batches) == len(loaders[0]) for batches in per_rank)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert set(seen) == set(range(n))
    assert len(seen) == -(-n // world) * world  # padded only up to a multiple of world_size


def test_matches_torch_distributed_sampler_order() -> None:
    n, world, batch = 43, 4, 3
    for rank in range(world):
        sampler = DistributedSampler(Squares(n), num_replicas=world, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(2)
        expected = [_ids(b) for b in DataLoader(Squares(n), batch_size=batch, sampler=sampler)]
        ours = DistributedDataLoader(Squares(n), batch, rank, world, seed=5, drop_last=False)
        ours.set_epoch(2)
        assert _epoch(ours) == expected


def test_deterministic_and_reshuffled_per_epoch() -> None:
    a, b = _loaders(50, 1, 5)[0], _loaders(50, 1, 5)[0]
    first_a, first_b = _epoch(a), _epoch(b)
    assert first_a == first_b
    assert a.epoch == 1  # advanced by itself at the end of the epoch
    second = _epoch(a)
    assert second != first_a and sorted(sum(second, [])) == sorted(sum(first_a, []))
    assert _epoch(DistributedDataLoader(Squares(50), 5, 0, 1, seed=1)) != first_a
    assert _epoch(DistributedDataLoader(Squares(12), 4, 0, 1, shuffle=False)) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                                    [8, 9, 10, 11]]


def test_set_epoch_jumps_but_keeps_position_within_the_same_epoch() -> None:
    loader = _loaders(30, 1, 3)[0]
    loader.data_sampler.set_epoch(4)  # DeepSpeed scripts' spelling
    epoch4 = _epoch(loader)
    fresh = _loaders(30, 1, 3)[0]
    fresh.set_epoch(4)
    it = iter(fresh)
    next(it)
    fresh.set_epoch(4)  # same epoch: no reset
    assert [_ids(b) for b in iter(fresh)] == epoch4[1:]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_resume_sees_exactly_the_uninterrupted_batches(drop_last: bool, k: int) -> None:
    world, n, batch = 3, 50, 4
    for rank in range(world):
        def make(rank: int = rank) -> DistributedDataLoader:
            return DistributedDataLoader(Squares(n), batch, rank, world, seed=3, drop_last=drop_last)

        reference = make()
        uninterrupted = [_ids(b) for b in itertools.islice(_chain_epochs(reference), 3 * len(reference))]
        run = make()
        it = _chain_epochs(run)
        consumed = [_ids(next(it)) for _ in range(k)]
        state = run.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        rest = [_ids(b) for b in itertools.islice(_chain_epochs(resumed), len(uninterrupted) - k)]
        assert consumed + rest == uninterrupted


def _chain_epochs(loader: DistributedDataLoader):
    """What a training loop sees over several epochs: ``for epoch...: for batch in loader``."""
    while True:
        yield from loader


def test_state_after_the_last_batch_points_at_the_next_epoch() -> None:
    loader = _loaders(12, 2, 3)[0]
    batches = list(iter(loader))
    assert len(batches) == 2 and loader.state_dict()["epoch"] == 1 and loader.state_dict()["offset"] == 0


def test_resume_at_another_world_size_continues_the_same_epoch() -> None:
    n = 48
    old = _loaders(n, 4, 2)
    for loader in old:
        it = iter(loader)
        next(it)
        next(it)
    state = old[0].state_dict()  # 2 steps * 4 ranks * 2 samples = 16 consumed
    assert state["offset"] == 16
    seen_before = {i for loader in _loaders(n, 4, 2) for b in itertools.islice(iter(loader), 2) for i in _ids(b)}
    new = _loaders(n, 2, 4)
    for loader in new:
        loader.load_state_dict(state)
    seen_after = [i for loader in new for b in loader for i in _ids(b)]
    assert len(seen_after) == len(set(seen_after)) == n - 16
    assert set(seen_after) | seen_before == set(range(n))


def test_load_rejects_a_position_for_other_data() -> None:
    state = _loaders(30, 1, 3)[0].state_dict()
    with pytest.raises(CheckpointError, match="dataset_len=30"):
        _loaders(31, 1, 3)[0].load_state_dict(state)
    with pytest.raises(CheckpointError, match="seed"):
        DistributedDataLoader(Squares(30), 3, 0, 1, seed=9).load_state_dict(state)


def test_custom_collate_fn_and_plain_sequences() -> None:
    loader = DistributedDataLoader([{"x": i} for i in range(8)], 2, 1, 2, shuffle=False,
                                   collate_fn=lambda samples: [s["x"] for s in samples])
    assert list(loader) == [[1, 3], [5, 7]]
    assert len(loader) == 2


def test_invalid_arguments() -> None:
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="map-style"):
        DistributedDataLoader(Stream(), 1, 0, 1)
    with pytest.raises(ValueError, match="rank"):
        DistributedDataLoader(Squares(4), 1, 2, 2)
    with pytest.raises(ValueError, match="batch_size"):
        DistributedDataLoader(Squares(4), 0, 0, 1)


def test_tiny_dataset_with_drop_last_yields_nothing_but_advances() -> None:
    loader = DistributedDataLoader(Squares(3), 2, 0, 2)
    assert len(loader) == 0 and list(loader) == [] and loader.epoch == 1


def test_worker_processes_give_the_same_batches_and_position() -> None:
    plain = _epoch(DistributedDataLoader(Squares(24), 3, 1, 2, seed=4))
    loader = DistributedDataLoader(Squares(24), 3, 1, 2, seed=4, num_workers=2)
    it = iter(loader)
    first = _ids(next(it))  # the workers prefetch ahead, the position does not
    assert loader.state_dict()["offset"] == 6
    assert [first] + [_ids(b) for b in it] == plain


@pytest.mark.parametrize("batch, steps", [(1, 29), (4, 7), (29, 1)])
def test_no_drop_last_resume_at_more_ranks_never_yields_an_empty_batch(batch: int, steps: int) -> None:
    """60 samples, saved at world 2 near the end of the epoch, resumed at world 3."""
    n = 60
    old = _loaders(n, 2, batch, drop_last=False)
    for loader in old:
        list(itertools.islice(iter(loader), steps))
    state = old[0].state_dict()
    assert state["epoch"] == 0 and state["offset"] == 2 * batch * steps
    new = _loaders(n, 3, batch, drop_last=False)
    for loader in new:
        loader.load_state_dict(state)
    per_rank = [[_ids(b) for b in loader] for loader in new]
    assert all(len(batches) == len(per_rank[0]) >= 1 for batches in per_rank)
    assert all(len(b) >= 1 for batches in per_rank for b in batches)
    seen = {i for batches in per_rank for b in batches for i in b}
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    assert set(order[state["offset"]:]) <= seen  # the rest of the epoch, padded from its start
    assert all(loader.epoch == 1 and loader.state_dict()["offset"] == 0 for loader in new)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_iterating_does_not_touch_the_global_rng(num_workers: int) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    loader = DistributedDataLoader(Squares(20), 3, 0, 2, drop_last=False, num_workers=num_workers)
    next(iter(loader))
    for _ in loader:  # a second iterator, then the rest of the epoch
        pass
    _epoch(loader)
    assert torch.equal(torch.get_rng_state(), before)


def _io(rank: int, world: int) -> dict:
    import dslaunch

    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 4})
    given, _ = engine.deepspeed_io(Squares(16)), engine.deepspeed_io(Squares(16), route="eval")
    sized = engine.deepspeed_io(Squares(16), batch_size=3, num_local_io_workers=0)
    ordered = engine.deepspeed_io(Squares(8), data_sampler=torch.utils.data.SequentialSampler(range(8)))
    return {"given": [_ids(b) for b in given], "sized": [len(_ids(b)) for b in sized],
            "ordered": [_ids(b) for b in ordered], "class": type(given).__name__,
            "initialize's": isinstance(dslaunch.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 4},
                                                           training_data=Squares(8))[2], DeepSpeedDataLoader)}


def test_engine_deepspeed_io_gives_each_rank_its_share() -> None:
    """DeepSpeed's ``engine.deepspeed_io``: the micro batch by default, the rank's own samples."""
    from tests.distributed import run_world

    got = run_world(_io, 2, timeout=50)
    shares = [sorted(i for b in r["given"] for i in b) for r in got]
    assert all(len(b) == 2 for r in got for b in r["given"])  # train_batch_size 4 over 2 ranks
    assert sorted(shares[0] + shares[1]) == list(range(16)) and not set(shares[0]) & set(shares[1])
    assert got[0]["sized"] == [3, 3, 2]  # 8 samples per rank; dataloader_drop_last is false by default
    assert got[0]["ordered"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the sampler decides
    assert got[0]["class"] == "DeepSpeedDataLoader" and got[0]["initialize's"]  # what scripts annotate with


def test_deepspeed_dataloader_takes_deepspeeds_constructor() -> None:
    """DeepSpeed's positional ``(dataset, batch_size, pin_memory, local_rank, tput_timer)`` and its
    data-parallel keywords: rank 1 of 2 gets what torch's ``DistributedSampler`` gives it, in
    batches; a ``data_sampler`` decides the order instead (and is ``loader.data_sampler``);
    ``dataloader_drop_last`` drops the short batch."""
    loader = DeepSpeedDataLoader(Squares(20), 4, False, 0, None, data_parallel_world_size=2, data_parallel_rank=1)
    sampler = DistributedSampler(Squares(20), num_replicas=2, rank=1, seed=0)
    assert [i for b in loader for i in _ids(b)] == list(sampler)
    assert len(loader) == 3 and loader.data_sampler is loader
    ordered = torch.utils.data.SequentialSampler(range(10))
    sampled = DeepSpeedDataLoader(Squares(10), 4, False, -1, None, data_sampler=ordered, dataloader_drop_last=True)
    assert [_ids(b) for b in sampled] == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(sampled) == 2
    assert sampled.data_sampler is ordered
    with pytest.raises(NotInDslaunchError, match="the position is the sampler's"):
        sampled.state_dict()
    alone = DeepSpeedDataLoader(Squares(6), 3, False, -1, None)  # no process group: one rank
    assert sorted(i for b in alone for i in _ids(b)) == list(range(6))
    with pytest.raises(UsageError, match="needs the ds_config's block there as 'data_efficiency'"):
        DeepSpeedDataLoader(Squares(6), 3, False, 0, None, deepspeed_dataloader_config={"curriculum_learning": True})
