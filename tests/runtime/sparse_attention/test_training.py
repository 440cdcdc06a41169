"""A tiny BERT-shaped model whose attention ``SparseAttentionUtils`` replaced trains under
``deepspeed.initialize`` at 2 gloo ranks: the loss of a task only attention solves (every
position's label is the sequence's first token) falls from ln(vocab) to under half of it in 80
steps (dense attention gets about as far: 3.47 -> 1.2 in one process), the ranks'
parameters stay equal, and BigBird's random layout, drawn differently on each rank, is rank 0's
everywhere after the first forward (``SparseSelfAttention`` broadcasts it)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.distributed import run_world

STEPS, VOCAB, SEQ = 80, 32, 64


def _train(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.ops.sparse_attention import BigBirdSparsityConfig, SparseAttentionUtils
    from tests.runtime.sparse_attention.models import TinyBert

    torch.manual_seed(0)
    model = TinyBert(vocab=VOCAB, hidden=32, heads=2, layers=2, positions=SEQ)
    random.seed(100 + rank)  # each rank draws another random layout
    layout = BigBirdSparsityConfig(num_heads=2, block=16, num_random_blocks=1, num_sliding_window_blocks=3)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(model, SEQ, layout)
    attn = model.bert.encoder.layer[0].attention.self.sparse_self_attention
    drawn = attn.master_layout.clone()
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (4, SEQ), generator=g)
        labels = ids[:, :1].expand(4, SEQ).clone()  # every position names the first token
        mask = torch.ones(4, SEQ, dtype=torch.long)
        loss = engine(ids, mask, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "drawn": drawn, "used": attn.master_layout.clone(), "params": flat}


@pytest.mark.timeout(180)
def test_sparse_bert_trains_at_two_ranks_with_one_layout() -> None:
    results = run_world(_train, 2, timeout=170)
    for r in results:
        first, last = sum(r["losses"][:3]) / 3, sum(r["losses"][-3:]) / 3
        assert abs(first - math.log(VOCAB)) < 0.5 and last < first / 2, r["losses"]
    assert torch.equal(results[0]["params"], results[1]["params"])
    assert not torch.equal(results[0]["drawn"], results[1]["drawn"])  # the ranks drew different layouts ...
    assert torch.equal(results[1]["used"], results[0]["drawn"])  # ... and use rank 0's
