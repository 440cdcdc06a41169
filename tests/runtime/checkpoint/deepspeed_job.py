"""One training job that real DeepSpeed and dslaunch both run, for the checkpoint interop tests.

As a script (``python deepspeed_job.py OUT.json``, one process per rank with RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT set) it runs under whichever ``deepspeed`` the interpreter imports: real
DeepSpeed in its own venv. ``run(deepspeed, ...)`` is the same job for dslaunch (``run_world``).

The job: a tiny MLP whose parameters have odd sizes (213 elements: DeepSpeed pads its flat
partitions), torch's AdamW as a client optimizer, DeepSpeed's ``WarmupLR`` from the config, and
a fixed global batch of 8 per step split evenly over the ranks, so the mean of the ranks' losses
is the same at any world size that divides 8.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

GLOBAL_BATCH = 8


def model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 10),
                               torch.nn.Tanh(), torch.nn.Linear(10, 3))


class MoENet(torch.nn.Module):
    """Linear, DeepSpeed's ``MoE`` (4 experts of ``Linear(8, 8)``, top-1, no token dropping),
    Linear; global expert ``g`` gets the same weights whichever rank holds it."""

    def __init__(self, deepspeed: Any, ep_size: int, rank: int) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.inp, self.out = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.moe = deepspeed.moe.layer.MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=ep_size, k=1,
                                           min_capacity=0, drop_tokens=False, use_rts=False)
        local = self.moe.num_local_experts
        with torch.no_grad():  # expert ranks are neighbours (DeepSpeed's default): rank % ep_size
            for j, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                gen = torch.Generator().manual_seed(50 + (rank % ep_size) * local + j)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(hidden)


def config(stage: int, world: int, bf16: bool = False, checkpoint: dict | None = None,
           zero: dict | None = None, data_types: dict | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, **(zero or {})},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 20}},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    if data_types:
        cfg["data_types"] = data_types
    return cfg


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def full_state(deepspeed: Any, engine: Any) -> dict[str, list[float]]:
    """Each parameter's whole fp32 master and Adam moments, through ``deepspeed.utils``'s
    ``safe_get_full_*`` (collective; stage 0 has no such state: empty)."""
    if engine.zero_optimization_stage() == 0:
        return {}
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = deepspeed.utils.safe_get_full_fp32_param(p).reshape(-1).tolist()
        for key in ("exp_avg", "exp_avg_sq"):
            try:
                out[f"{name}:{key}"] = deepspeed.utils.safe_get_full_optimizer_state(p, key).reshape(-1).tolist()
            except ValueError:  # DeepSpeed 0.19.8's fragments of MoE groups: "exp_avg not found"
                pass
    return out


def run(deepspeed: Any, rank: int, world: int, stage: int, first: int, steps: int,
        load: str | None = None, save: str | None = None, save_at: int | None = None, bf16: bool = False,
        load_kwargs: dict | None = None, probe: bool = True, checkpoint: dict | None = None,
        zero: dict | None = None, ep_size: int = 0, data_types: dict | None = None) -> dict[str, Any]:
    """Train steps ``first``..``first + steps - 1``; load ``load`` before, save into ``save`` before
    step ``save_at`` (default: after the last step); ``checkpoint``: the config's ``checkpoint`` block, ``zero``: more
    ``zero_optimization`` keys, ``data_types``: its block (``grad_accum_dtype: "fp32"`` with bf16 at
    ZeRO-1: DeepSpeed's ``BF16_Optimizer``).

    Returns this rank's losses, what ``load_checkpoint`` returned (path, client state), the
    engine's counters and LR after loading, and (``probe``) the ``full_state`` after loading or
    when saving. ``ep_size``: train ``MoENet`` with its experts over that many ranks instead.
    """
    if ep_size:  # real DeepSpeed's package does not import its moe modules itself
        import importlib

        for name in ("moe.layer", "moe.utils"):
            importlib.import_module(f"{deepspeed.__name__}.{name}")
    net = MoENet(deepspeed, ep_size, rank) if ep_size else model()
    params = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "p"}) if ep_size else net.parameters()
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config(stage, world, bf16, checkpoint, zero,
                                                                                    data_types))
    out: dict[str, Any] = {"losses": []}
    if load is not None:
        path, client = engine.load_checkpoint(load, **(load_kwargs or {}))
        out.update(path=path, client=client, global_steps=engine.global_steps,
                   global_samples=engine.global_samples, skipped_steps=engine.skipped_steps,
                   lr=engine.lr_scheduler.get_last_lr())
        if probe:
            out["state"] = full_state(deepspeed, engine)
    dtype = torch.bfloat16 if bf16 else torch.float32
    for step in range(first, first + steps):
        if save is not None and step == save_at:
            engine.save_checkpoint(save, client_state={"note": "from the job", "step": step})
            out["state"] = full_state(deepspeed, engine)
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    if save is not None and save_at is None:
        engine.save_checkpoint(save, client_state={"note": "from the job", "step": first + steps})
    return out


def main(job: Any = None) -> None:
    """Run ``job`` (``run`` by default; another job script's ``run`` with the same arguments) on this
    rank under the ``deepspeed`` the interpreter imports, and write its results to ``OUT.rankR``."""
    import importlib

    import deepspeed

    # DeepSpeed's CPU shared-memory all-reduce (inference only) is a JIT build of minutes: not used
    # (the module by its full name: the package's ``torch`` attribute is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    importlib.import_module(f"{deepspeed.__name__}.pipe")  # real DeepSpeed's package does not import it
    args = json.loads(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    out = (job or run)(deepspeed, rank, world, **args)
    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        json.dump({k: v for k, v in out.items() if k != "client" or job is not None}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Real DeepSpeed's process may still abort in C++ teardown after this ("terminate called without
    # an active exception", SIGABRT: torch's modules keep the default group alive into finalization,
    # pytorch/pytorch#179291; dslaunch's runtime/shutdown.py drops those references, DeepSpeed does
    # not). Seen once in a fresh-clone CI run (rank 1 exit -6 after both ranks had written their
    # results). The results are on disk: leave without the interpreter's finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
