"""``"sequence_parallel_size": N`` trains as the same job without it: a plain-torch causal LM
(grouped-query attention with one key/value head, fewer than the sequence ranks) on sequences of
63 tokens (not a multiple of N: padded and masked), 20 steps at ZeRO 0, 1, 2 and 3, fp32. Per step,
every rank's loss and the averaged gradient equal those of the sp=1 run over the same samples
(world 2 at sp 2 against one process, ZeRO 0 and 1; world 4 at sp 2 x dp 2 against dp 2, ZeRO 2
and 3, and at sp 4 against one process, ZeRO 3)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_world

VOCAB, HIDDEN, HEADS, KV_HEADS, LENGTH, MICRO, STEPS = 48, 16, 4, 1, 63, 2, 20


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2)


class Block(torch.nn.Module):
    def __init__(self, attend: torch.nn.Module | None) -> None:
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.n1, self.n2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.q = torch.nn.Linear(HIDDEN, HIDDEN)
        self.kv = torch.nn.Linear(HIDDEN, 2 * KV_HEADS * self.head_dim)
        self.o = torch.nn.Linear(HIDDEN, HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                       torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.attend = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, s, HEADS, self.head_dim)
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, self.head_dim).unbind(2)
        a = _causal(q, k, v) if self.attend is None else self.attend(q, k, v, batch_dim_idx=0)
        x = x + self.o(a.reshape(b, s, HIDDEN))
        return x + self.mlp(self.n2(x))


class TinyLM(torch.nn.Module):
    """Token and learned position embeddings, two blocks, a head. With ``sequence_parallel`` the
    attention is Ulysses' and the loss of its shard is averaged over the whole sequence's counted
    tokens, in the group ``set_group`` gives (the engine's, made by ``initialize``)."""

    def __init__(self, sequence_parallel: bool = False) -> None:
        super().__init__()
        from dslaunch.sequence.layer import DistributedAttention

        attend = DistributedAttention(_causal, None, scatter_idx=2, gather_idx=1) if sequence_parallel else None
        self.attend, self.sp_group = attend, None
        self.checkpoint: Any = None  # a checkpoint function to run each block under (test_composition.py)
        self.tok, self.pos = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Embedding(128, HIDDEN)
        self.blocks = torch.nn.ModuleList([Block(attend), Block(attend)])
        self.norm, self.head = torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, VOCAB)

    def set_group(self, group: object) -> None:
        self.sp_group = self.attend.spg = group

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        from dslaunch.runtime.sequence_parallel.loss import sequence_parallel_loss

        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x) if self.checkpoint is None else self.checkpoint(block, x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-100)
        if self.sp_group is None:
            return loss
        return sequence_parallel_loss(loss, (shift_labels != -100).sum(), self.sp_group)


def samples(step: int, replica: int) -> dict[str, torch.Tensor]:
    """The micro batch replica ``replica`` trains on at ``step``; the first 5 tokens are a prompt
    (ignored labels), as in SFT."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    ids = torch.randint(0, VOCAB, (MICRO, LENGTH), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "labels": labels}


def _train(rank: int, world: int, sp: int, stage: int) -> dict[str, list]:
    import dslaunch as deepspeed
    from dslaunch.runtime.sequence_parallel.batch import shard_batch
    from dslaunch.runtime.zero.full_state import safe_get_full_grad
    from dslaunch.utils import groups

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if sp > 1:
        config["sequence_parallel_size"] = sp
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyLM(sequence_parallel=sp > 1)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    assert engine.train_batch_size() == MICRO * world // sp
    replica = groups._get_data_parallel_rank()
    sp_rank = groups._get_sequence_parallel_rank()
    if sp > 1:  # the group exists once the engine is built (DeepSpeed's engine.seq_parallel_group)
        model.set_group(engine.seq_parallel_group)
        assert groups._get_sequence_parallel_group() is engine.seq_parallel_group
        assert groups._get_sequence_parallel_world_size() == sp
        assert groups._get_sequence_data_parallel_world_size() == world
    losses, grads = [], []
    for step in range(STEPS):
        batch = shard_batch(samples(step, replica), sp_rank, sp)  # sp 1: the whole sequence, labels shifted
        loss = engine(**batch)
        engine.backward(loss)
        grads.append(torch.cat([safe_get_full_grad(p).reshape(-1) for p in engine.module.parameters()]))
        engine.step()
        losses.append(float(loss))
    return {"replica": replica, "losses": losses, "grads": [g.tolist() for g in grads]}


def _compare(sp_run: list[dict], reference: list[dict]) -> tuple[float, float]:
    by_replica = {r["replica"]: r for r in reference}
    loss_err = grad_err = 0.0
    for run in sp_run:
        ref = by_replica[run["replica"]]
        loss_err = max(loss_err, *(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)))
        for got, want in zip(run["grads"], ref["grads"], strict=True):
            grad_err = max(grad_err, float((torch.tensor(got) - torch.tensor(want)).abs().max()))
    return loss_err, grad_err


# Every ZeRO stage once and every layout once (suite time: ~10 s a case; the 10-case grid of every
# stage at every layout ran the same): stages 0 and 1 at sp 2 alone, 2 and 3 at sp 2 x dp 2, and
# sp 4 (one key/value head repeated 4 times, 16 positions a rank) at stage 3.
_LAYOUTS = [(2, 2, 0), (2, 2, 1), (4, 2, 2), (4, 2, 3), (4, 4, 3)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("world", "sp", "stage"), _LAYOUTS)
def test_sequence_parallel_training_equals_the_sp1_run(world: int, sp: int, stage: int) -> None:
    reference = run_world(_train, world // sp, 1, stage, timeout=200)
    sp_run = run_world(_train, world, sp, stage, timeout=200)
    loss_err, grad_err = _compare(sp_run, reference)
    assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)


def _first_batch(rank: int, world: int) -> tuple[int, int, list[int]]:
    import dslaunch as deepspeed
    from dslaunch.utils import groups

    data = torch.utils.data.TensorDataset(torch.arange(32))
    engine, _, loader, _ = deepspeed.initialize(
        model=torch.nn.Linear(2, 2), training_data=data,
        config={"train_batch_size": 4, "sequence_parallel_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.seq_data_parallel_group is engine.zero.pg and engine.zero.world_size == 4
    return groups._get_data_parallel_rank(), groups._get_sequence_parallel_rank(), next(iter(loader))[0].tolist()


@pytest.mark.timeout(120)
def test_the_sequence_ranks_of_a_replica_read_the_same_samples() -> None:
    """The loader shards samples over the data axis only; train_batch_size counts data ranks."""
    got = run_world(_first_batch, 4, timeout=90)
    assert [(d, s) for d, s, _ in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert got[0][2] == got[1][2] and got[2][2] == got[3][2] and got[0][2] != got[2][2]
    assert all(len(b) == 2 for _, _, b in got)  # 4 samples over 2 data ranks


def _refused(rank: int, world: int, config: dict, mpu_sp: int) -> str:
    import dslaunch as deepspeed
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.parallel.grid import sequence_grid

    deepspeed.init_distributed(dist_backend="gloo")
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    mpu = sequence_grid(mpu_sp) if mpu_sp > 1 else None
    try:
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config={**base, **config}, mpu=mpu)
    except ConfigError as err:
        return str(err)
    return "accepted"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("config", "mpu_sp", "message"), [
    ({"sequence_parallel_size": 2, "gradient_allreduce_op": "sum"}, 1, "'gradient_allreduce_op': \"sum\" with sequence"),
    ({"sequence_parallel_size": 4}, 2, "'sequence_parallel_size': 4, but the mpu given to initialize() splits each "
                                       "sequence over 2 rank(s)"),
    ({"sequence_parallel_size": 3}, 1, "'sequence_parallel_size': sequence_parallel_size=3 must divide the world size 2"),
], ids=["sum", "mpu-disagrees", "indivisible"])
def test_configs_that_would_train_wrongly_are_refused(config: dict, mpu_sp: int, message: str) -> None:
    assert all(got.startswith(message) for got in run_world(_refused, 2, config, mpu_sp, timeout=100))
