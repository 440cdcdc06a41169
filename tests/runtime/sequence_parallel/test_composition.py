"""Sequence parallelism with the engine's other parts, on test_engine.py's plain-torch LM (one
key/value head, SP 2 at world 2 against one process): the flops profiler counts attention once per
sequence (each rank 1/N of it, the model's flops summed over the sequence group equal the one
process's) with activation checkpointing on (DeepSpeed's reentrant checkpoint around each block,
the all-to-alls recomputed in backward, its inputs in host memory), which gives the one process's
losses and gradients; bf16 trains as the bf16 run without SP."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.sequence_parallel.test_engine import MICRO, VOCAB, TinyLM, _compare

STEPS = 4


def _run(rank: int, world: int, sp: int, extra: dict, checkpointed: bool, length: int) -> dict:
    import dslaunch as deepspeed
    from dslaunch.runtime.sequence_parallel.batch import shard_batch
    from dslaunch.runtime.zero.full_state import safe_get_full_grad
    from dslaunch.utils import groups

    config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 1000, **extra}
    if sp > 1:
        config["sequence_parallel_size"] = sp
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyLM(sequence_parallel=sp > 1)
    if checkpointed:
        model.checkpoint = deepspeed.checkpointing.checkpoint
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    if sp > 1:
        model.set_group(engine.seq_parallel_group)
    losses, grads = [], []
    ids = torch.randint(0, VOCAB, (MICRO, length), generator=torch.Generator().manual_seed(0))  # one batch: learnable
    for _ in range(STEPS):
        batch = shard_batch({"input_ids": ids, "labels": ids}, groups._get_sequence_parallel_rank(), sp)
        loss = engine(**batch)
        engine.backward(loss)
        grads.append(torch.cat([safe_get_full_grad(p).float().reshape(-1) for p in engine.module.parameters()]))
        engine.step()
        losses.append(float(loss))
    out = {"replica": 0, "losses": losses, "grads": [g.tolist() for g in grads]}
    profiler = getattr(engine, "flops_profiler", None)
    if profiler is not None:
        p, t = profiler.last, profiler.timing
        out["attention"] = sum(f for op, f in p.ops if "scaled_dot_product" in op)
        out["flops"], out["model_flops"], out["tokens"] = p.fwd_flops + p.bwd_flops, t.model_flops, t.tokens_per_s * t.iter_s
    return out


@pytest.mark.timeout(200)
def test_checkpointed_blocks_train_as_sp1_and_the_profiler_counts_attention_once(tmp_path) -> None:
    from dslaunch.runtime.profiling import mfu

    os.environ[mfu.CACHE_ENV] = str(tmp_path / "peak.json")
    profiler = {"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(tmp_path / "f.txt")}}
    one = run_world(_run, 1, 1, profiler, True, 64, timeout=150)[0]
    cpu = {"activation_checkpointing": {"cpu_checkpointing": True}}
    two = run_world(_run, 2, 2, {**profiler, **cpu}, True, 64, timeout=150)
    loss_err, grad_err = _compare(two, [one])
    assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)
    assert one["attention"] > 0 and one["model_flops"] == one["flops"]
    for rank in two:  # each rank: half the heads over the whole sequence, half the tokens elsewhere
        assert 2 * rank["attention"] == one["attention"] and 2 * rank["flops"] == one["flops"]
        assert rank["model_flops"] == one["flops"]  # summed over the sequence group: the sequence once
        assert rank["tokens"] == pytest.approx(one["tokens"])  # every rank's tokens, once: MICRO x 64


@pytest.mark.timeout(200)
def test_bf16_trains_as_the_bf16_run_without_sequence_parallelism() -> None:
    bf16 = {"bf16": {"enabled": True}}
    one = run_world(_run, 1, 1, bf16, False, 63, timeout=150)
    two = run_world(_run, 2, 2, bf16, False, 63, timeout=150)
    loss_err, grad_err = _compare(two, one)
    # bf16 rounding of other operation orders: a loss of ~4 is a bf16 value, whose step is 2**-5 there
    assert loss_err <= 2**-5 and grad_err < 1e-2, (loss_err, grad_err)
    assert one[0]["losses"][0] - one[0]["losses"][-1] > 0.1  # and it trains
