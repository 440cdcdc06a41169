"""Resharding ZeRO state on synthetic shards built with the one partition rule."""

from __future__ import annotations

import math

import pytest
import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.reshard import (
    assemble,
    check_compatible,
    fp32_params,
    needed_ranks,
    partition_map,
)
from dslaunch.runtime.zero.partition import partition_range

SHAPES = [[("w1", (3, 5)), ("b1", (5,)), ("w2", (7, 2))], [("ln", (3,))]]  # numel 34 and 3


def consolidate(shards: list[dict]) -> dict:
    """All shards -> one state dict whose groups span [0, numel), as the fp32 export builds it."""
    return assemble(shards, [(0, int(g["numel"])) for g in shards[0]["groups"]])


def _full_state(seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for gi, params in enumerate(SHAPES):
        numel = sum(math.prod(s) for _, s in params)
        groups.append({"names": [n for n, _ in params], "shapes": [s for _, s in params],
                       "numel": numel, "master": torch.randn(numel, generator=gen),
                       "optim_state": {"exp_avg": torch.randn(numel, generator=gen),
                                       "exp_avg_sq": torch.rand(numel, generator=gen)},
                       "optim_scalars": {"step": torch.tensor(float(10 + gi))},
                       "hparams": {"lr": 0.1 * (gi + 1), "betas": (0.9, 0.99)}})
    return groups


def _shards(full: list[dict], world: int, stage: int) -> list[dict]:
    """What each rank's ``strategy.state_dict()`` would return (stage 0: every rank holds all)."""
    out = []
    for rank in range(world):
        groups = []
        for g in full:
            a, b = (0, g["numel"]) if stage == 0 else partition_range(g["numel"], world, rank)
            groups.append({**g, "start": a, "end": b, "master": g["master"][a:b].clone(),
                           "optim_state": {k: v[a:b].clone() for k, v in g["optim_state"].items()}})
        out.append({"stage": stage, "world_size": world, "rank": rank, "groups": groups})
    return out


def _assert_slice_of(group: dict, full: dict, a: int, b: int) -> None:
    assert (group["start"], group["end"]) == (a, b)
    assert torch.equal(group["master"], full["master"][a:b])
    assert set(group["optim_state"]) == set(full["optim_state"])
    for k, v in group["optim_state"].items():
        assert torch.equal(v, full["optim_state"][k][a:b]), k
    assert group["optim_scalars"] == full["optim_scalars"] and group["hparams"] == full["hparams"]


@pytest.mark.parametrize("n,m,stage_in,stage_out", [
    (4, 2, 2, 2), (2, 3, 2, 2), (2, 3, 1, 2), (4, 2, 2, 0), (1, 3, 0, 2), (3, 4, 2, 1), (4, 4, 2, 2),
])
def test_reshard_between_world_sizes_and_stages(n: int, m: int, stage_in: int, stage_out: int) -> None:
    full = _full_state()
    saved = _shards(full, n, stage_in)
    if stage_in == 0:
        saved = saved[:1]  # stage 0 checkpoints store one copy
    pmap = partition_map(saved)
    for rank in range(m):
        targets = [(0, g["numel"]) if stage_out == 0 else partition_range(g["numel"], m, rank)
                   for g in full]
        need = needed_ranks(pmap, targets)
        got = assemble([saved[r] for r in need], targets)
        for g, f, (a, b) in zip(got["groups"], full, targets, strict=True):
            _assert_slice_of(g, f, a, b)


def test_a_rank_reads_only_overlapping_shards() -> None:
    pmap = partition_map(_shards(_full_state(), 4, 2))  # group 0: k=9 -> [0,9) [9,18) [18,27) [27,34)
    assert needed_ranks(pmap, [partition_range(34, 2, 0), partition_range(3, 2, 0)]) == [0, 1]
    assert needed_ranks(pmap, [partition_range(34, 2, 1), partition_range(3, 2, 1)]) == [1, 2, 3]
    assert needed_ranks(pmap, [(0, 34), (0, 3)]) == [0, 1, 2, 3]


def test_padding_leaves_empty_shards() -> None:
    full = _full_state()
    saved = _shards(full, 2, 2)
    # group 1 has 3 elements: at 4 ranks k=1, rank 3 owns nothing
    assert partition_range(3, 4, 3) == (3, 3)
    targets = [partition_range(g["numel"], 4, 3) for g in full]
    got = assemble([saved[r] for r in needed_ranks(partition_map(saved), targets)], targets)
    assert got["groups"][1]["master"].numel() == 0
    assert got["groups"][1]["optim_state"]["exp_avg"].numel() == 0
    _assert_slice_of(got["groups"][0], full[0], *targets[0])


def test_consolidate_round_trip_is_exact() -> None:
    full = _full_state(3)
    one = consolidate(_shards(full, 4, 2))
    for g, f in zip(one["groups"], full, strict=True):
        _assert_slice_of(g, f, 0, f["numel"])
    again = consolidate(_shards([{**g} for g in one["groups"]], 3, 2))  # stage 2 -> 0 -> 2 -> 0
    for g, f in zip(again["groups"], full, strict=True):
        _assert_slice_of(g, f, 0, f["numel"])


def test_fp32_params_shapes_and_values() -> None:
    full = _full_state()
    params = fp32_params(consolidate(_shards(full, 3, 2)))
    assert list(params) == ["w1", "b1", "w2", "ln"]
    assert params["w2"].shape == (7, 2) and params["w2"].dtype == torch.float32
    assert torch.equal(params["b1"], full[0]["master"][15:20])
    assert torch.equal(params["ln"], full[1]["master"])


def test_missing_shard_is_an_error() -> None:
    saved = _shards(_full_state(), 4, 2)
    with pytest.raises(CheckpointError, match=r"do not cover elements \[9, 18\)"):
        assemble([saved[0], saved[2], saved[3]], [(0, 34), (0, 3)])


def test_incompatible_model_is_named() -> None:
    pmap = partition_map(_shards(_full_state(), 2, 2))
    live = {"groups": [{"names": ["w1", "b1", "w2"], "shapes": [(3, 5), (5,), (2, 7)]},
                       {"names": ["ln"], "shapes": [(3,)]}]}
    with pytest.raises(CheckpointError, match=r"'w2' has shape \(7, 2\) in the checkpoint, \(2, 7\)"):
        check_compatible(pmap, live, "m.json")
    live["groups"][0] = {"names": ["w1", "b1"], "shapes": [(3, 5), (5,)]}
    with pytest.raises(CheckpointError, match="only the checkpoint has \\['w2'\\]"):
        check_compatible(pmap, live, "m.json")
    with pytest.raises(CheckpointError, match="2 optimizer param groups, this engine has 1"):
        check_compatible(pmap, {"groups": live["groups"][:1]}, "m.json")
