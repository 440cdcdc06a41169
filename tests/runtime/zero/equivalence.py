"""Each ZeRO stage against plain torch: what ``test_stage0/1/2.py`` (and the Lamb test) share.

Plain torch trains one process on the whole global batch (``reference_losses``); an engine trains
the same model init on the same global batch, split across gloo ranks and 2 accumulation micro
steps (``engine_losses``), with AdamW and weight decay, gradient clipping that is active, tiny
buckets so reductions and gathers span many buckets and partitions cut through parameters. fp32
must match within 1e-5 relative per step over 20 steps; a bf16/fp16 run tracks the fp32 reference
within 3e-2 relative per step (16-bit forward math).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed import run_world
from tests.runtime.models import batches, make_model

STEPS, GLOBAL, GAS, LR, WD, CLIP = 20, 8, 2, 1e-2, 0.01, 0.5


def config(stage: int, **extra) -> dict:
    return {"train_batch_size": GLOBAL, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                  "allgather_bucket_size": 200, "overlap_comm": True,
                                  "overlap_param_gather": True},
            "steps_per_print": 1000, **extra}


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def reference_run(steps: int = STEPS, make_optimizer=_adamw
                  ) -> tuple[torch.nn.Module, list[float], list[float]]:
    """Plain torch: one process, the whole global batch per step; the trained model, the losses
    and the gradient norms before clipping."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    losses, norms = [], []
    for tokens, labels in batches(steps, GLOBAL):
        loss = model(tokens, labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, norms


def reference_losses(steps: int = STEPS, make_optimizer=_adamw) -> list[float]:
    return reference_run(steps, make_optimizer)[1]


def train_steps(engine, rank: int, world: int, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """One optimizer step per global batch in ``data``, GAS micro steps each; the global mean losses."""
    micro = GLOBAL // (world * GAS)
    losses = []
    for tokens, labels in data:
        step_loss = torch.zeros(())
        for i in range(GAS):
            lo = (i * world + rank) * micro  # any fixed split of the global batch works
            loss = engine(tokens[lo:lo + micro], labels[lo:lo + micro])
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / GAS
        if dist.is_initialized():
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    return losses


def engine_losses(rank: int, world: int, config: dict, client: bool = False, zero_init: bool = False,
                  weights: dict | None = None) -> list[float]:
    """Train through dslaunch.initialize; return the global mean loss of every step.

    ``zero_init``: build the model inside ``dslaunch.zero.Init()`` (partitioned as it is built).
    ``weights``: filled with the whole fp32 value of every parameter after the last step.
    """
    import dslaunch
    import dslaunch.zero

    with dslaunch.zero.Init(enabled=zero_init):
        model = make_model()
    kwargs = {}
    if client:  # a client optimizer and scheduler instead of config sections
        config = {k: v for k, v in config.items() if k != "optimizer"}
        kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(kwargs["optimizer"], lambda s: 1.0)
    engine, _, _, _ = dslaunch.initialize(model=model, config=config, **kwargs)
    dtype = next(engine.module.parameters()).dtype
    losses = train_steps(engine, rank, world, batches(STEPS, GLOBAL))
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * GAS
    if weights is not None:
        from dslaunch.utils import safe_get_full_fp32_param

        weights.update({n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()})
    assert dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
        next((k for k in ("fp16", "bf16") if config.get(k, {}).get("enabled")), ""), torch.float32)
    return losses


def assert_close(got: list[float], want: list[float], rtol: float, what: str = "") -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rtol * abs(w), f"{what}step {step}: {g} vs reference {w} (rtol {rtol})"


def many(rank: int, world: int, configs: list[dict], client: bool = False) -> list[list[float]]:
    # One process set for several engines: process start-up (torch.optim import) dominates.
    return [engine_losses(rank, world, cfg, client) for cfg in configs]


def check(world: int, configs: list[dict], reference: list[float], rtol: float, *, client: bool = False,
          every_rank: bool = False) -> None:
    """Train every config on ``world`` ranks; rank 0's (or every rank's) losses match ``reference``."""
    results = run_world(many, world, configs, client)
    for rank_results in results if every_rank else results[:1]:
        for losses in rank_results:
            assert_close(losses, reference, rtol)


def config_prescaled(stage: int) -> dict:
    """Gradients pre-divided by 4 before an unoverlapped fp32 reduction."""
    cfg = config(stage, prescale_gradients=True, gradient_predivide_factor=4.0, communication_data_type="fp32")
    cfg["zero_optimization"]["overlap_comm"] = False
    return cfg


def config_16bit(precision: str, stage: int) -> dict:
    return config(stage, **{precision: {"enabled": True,
                                         **({"initial_scale_power": 8} if precision == "fp16" else {})}})
