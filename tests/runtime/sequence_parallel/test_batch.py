"""A batch cut for a sequence group (``shard_batch``), the adapter that trains a group on its
ranks' batches in turn (``UlyssesSPDataLoaderAdapter``), and the loss weighted over the shards."""

from __future__ import annotations

import datetime

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.batch import shard_batch
from tests.distributed import run_world


def test_shards_pad_shift_and_count_positions_over_the_whole_sequence() -> None:
    ids = torch.arange(1, 8).unsqueeze(0)  # 7 tokens over 2 ranks: padded to 8
    labels = ids.clone()
    labels[0, 0] = -100
    parts = [shard_batch({"input_ids": ids, "labels": labels, "name": "x"}, r, 2, pad_token_id=9) for r in (0, 1)]
    assert [p["input_ids"].tolist() for p in parts] == [[[1, 2, 3, 4]], [[5, 6, 7, 9]]]
    # each position's label is the next token's; the last real one and the pad predict nothing
    assert [p["shift_labels"].tolist() for p in parts] == [[[2, 3, 4, 5]], [[6, 7, -100, -100]]]
    assert [p["position_ids"].tolist() for p in parts] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert all("labels" not in p and p["name"] == "x" and p["input_ids"].is_contiguous() for p in parts)


def test_a_tensor_of_another_length_is_named() -> None:
    with pytest.raises(UsageError, match=r"batch\['attention_mask'\] has shape \(1, 3\)"):
        shard_batch({"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 3)}, 0, 2)
    with pytest.raises(UsageError, match="needs input_ids"):
        shard_batch({"tokens": torch.zeros(1, 4)}, 0, 2)


def _adapter(rank: int, world: int) -> tuple[int, list[list[int]], float, float]:
    import torch.distributed as dist

    from dslaunch.runtime.sequence_parallel.loss import sequence_parallel_loss
    from dslaunch.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    # rank r reads sequences of 3 + r tokens (lengths differ between ranks), two batches
    mine = [{"input_ids": torch.full((1, 3 + rank), 10 * rank + i)} for i in range(2)]
    loader = UlyssesSPDataLoaderAdapter(mine, sp_rank=rank, sp_group=None, sp_world_size=world, device="cpu")
    got = [b["input_ids"][0].tolist() for b in loader]
    # shard losses 1.0 over 3 tokens and 3.0 over 1 token: (3 + 3) / 4, and the gradient of each
    # rank's loss is its weight times the group's size (summed over the ranks that backpropagate)
    loss = torch.tensor(1.0 + 2 * rank, requires_grad=True)
    total = sequence_parallel_loss(loss, 3 - 2 * rank, None)
    total.backward()
    return len(loader), got, float(total), float(loss.grad)


@pytest.mark.timeout(60)
def test_the_adapter_trains_on_each_ranks_batch_in_turn_and_the_loss_weighs_tokens() -> None:
    (n0, got0, total0, grad0), (n1, got1, total1, grad1) = run_world(_adapter, 2, timeout=45)
    assert n0 == n1 == 4
    # batch 0 of rank 0 (3 tokens, padded to 4), batch 0 of rank 1 (4 tokens), then batch 1 of each
    assert got0 == [[0, 0], [10, 10], [1, 1], [11, 11]]
    assert got1 == [[0, 0], [10, 10], [1, 0], [11, 11]]
    assert total0 == total1 == 1.5
    assert (grad0, grad1) == (2 * 3 / 4, 2 * 1 / 4)
