"""One pipeline training job that real DeepSpeed and dslaunch both run, for the checkpoint interop
tests of DeepSpeed's pipeline layout (``layer_XX-model_states.pt``, ``mp_rank_SS_...``).

As a script (``python deepspeed_pipe_job.py OUT ARGS_JSON``, one process per rank with RANK/
WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) it runs under whichever ``deepspeed`` the interpreter
imports (``deepspeed_job.main``). ``run(deepspeed, ...)`` is the same job for dslaunch (``run_world``).

The job: a ``PipelineModule`` of six layers (four ``Linear`` with odd sizes: DeepSpeed pads its
flat partitions), torch's AdamW as a client optimizer, ZeRO-1, DeepSpeed's ``WarmupLR``, and 4
micro batches of 2 samples per step over all replicas: the same global batch at any data-parallel
degree that divides 4. ``train_batch`` returns the step's loss averaged over that batch.
"""

from __future__ import annotations

from typing import Any

import torch

MICRO, MICRO_PER_STEP, WIDTH = 2, 4, 5


def layers(deepspeed: Any) -> list[Any]:
    spec, lin, tanh = deepspeed.pipe.LayerSpec, torch.nn.Linear, torch.nn.Tanh
    return [spec(lin, WIDTH, 7), spec(tanh), spec(lin, 7, 9), spec(tanh), spec(lin, 9, 3), spec(lin, 3, 1)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)


def config(dp: int, stage: int, checkpoint: dict | None = None, bf16: bool = False,
           data_types: dict | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICRO_PER_STEP // dp,
        "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 20}},
    }
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if data_types:
        cfg["data_types"] = data_types
    return cfg


def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """All replicas' micro batches of optimizer step ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(MICRO_PER_STEP):
        x = torch.randn(MICRO, WIDTH, generator=g)
        out.append((x, x.sin().sum(1, keepdim=True)))
    return out


def data(first: int, steps: int, dp: int, replica: int, dtype: torch.dtype = torch.float32) -> Any:
    """This replica's micro batches; the inputs in ``dtype`` (DeepSpeed's pipeline casts none)."""
    gas = MICRO_PER_STEP // dp
    for step in range(first, first + steps):
        yield from ((x.to(dtype), y) for x, y in micro_batches(step)[replica * gas:(replica + 1) * gas])


def full_state(deepspeed: Any, engine: Any) -> dict[str, list[float]]:
    """This stage's parameters' whole fp32 masters and Adam moments (``safe_get_full_*``), by
    their global layer names (``<layer>.<param>``)."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = deepspeed.utils.safe_get_full_fp32_param(p).reshape(-1).tolist()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}:{key}"] = deepspeed.utils.safe_get_full_optimizer_state(p, key).reshape(-1).tolist()
    return out


def wrapper(optimizer: Any) -> dict[str, Any]:
    """What ``engine.optimizer`` answers that scripts read: its class, whether it wraps a torch
    optimizer, and its loss-scale names (absent ones as None)."""
    names = ("cur_scale", "dynamic_loss_scale", "overflow")
    return {"class": type(optimizer).__name__, "inner": type(getattr(optimizer, "optimizer", None)).__name__,
            "needs_scaler": optimizer.needs_scaler() if hasattr(optimizer, "needs_scaler") else "absent",
            "clip_grad": getattr(optimizer, "clip_grad", None),
            "loss_scaler": type(optimizer.loss_scaler).__name__ if hasattr(optimizer, "loss_scaler") else "absent",
            **{n: (getattr(optimizer, n) if hasattr(optimizer, n) else "absent") for n in names}}


def run(deepspeed: Any, rank: int, world: int, stages: int, first: int, steps: int, stage: int = 1, load: str | None = None,
        save: str | None = None, save_at: int | None = None, checkpoint: dict | None = None,
        load_kwargs: dict | None = None, probe: bool = True, bf16: bool = False,
        data_types: dict | None = None) -> dict[str, Any]:
    """Train steps ``first``..``first + steps - 1``; load ``load`` before, save into ``save`` before
    step ``save_at`` (default: after the last step). Returns the losses, what ``load_checkpoint``
    returned, the counters after loading and (``probe``) the ``full_state`` after loading or at the
    save (DeepSpeed's ``safe_get_full_*`` fail before its first step after a load: no probe there),
    and what ``engine.optimizer`` answers (``wrapper``)."""
    torch.manual_seed(1234)
    net = deepspeed.pipe.PipelineModule(layers(deepspeed), num_stages=stages, loss_fn=loss_fn,
                                        partition_method="uniform", base_seed=1234, seed_layers=True)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.01, betas=(0.9, 0.99),
                            weight_decay=0.01)
    dp = world // stages
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config(dp, stage, checkpoint, bf16,
                                                                                    data_types))
    replica = engine.grid.get_data_parallel_rank()
    out: dict[str, Any] = {"losses": [], "wrapper": wrapper(engine.optimizer)}
    if load is not None:
        path, client = engine.load_checkpoint(load, **(load_kwargs or {}))
        out.update(path=path, client={k: v for k, v in (client or {}).items() if isinstance(v, (int, str, float))},
                   global_steps=engine.global_steps, global_samples=engine.global_samples,
                   lr=engine.lr_scheduler.get_last_lr())
        if probe:
            out["state"] = full_state(deepspeed, engine)
    it = data(first, steps, dp, replica, torch.bfloat16 if bf16 else torch.float32)
    for step in range(first, first + steps):
        if save is not None and step == save_at:
            engine.save_checkpoint(save, client_state={"note": "from the job", "step": step})
            out["state"] = full_state(deepspeed, engine)
        out["losses"].append(float(engine.train_batch(it)))
    if save is not None and save_at is None:
        engine.save_checkpoint(save, client_state={"note": "from the job", "step": first + steps})
        out["state"] = full_state(deepspeed, engine)
    return out


if __name__ == "__main__":  # run as a script: its folder is on the path
    import deepspeed_job

    deepspeed_job.main(run)
