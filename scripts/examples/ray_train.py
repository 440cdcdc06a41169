"""DeepSpeed inside Ray Train, and the same training loop under dslaunch.

Ray's DeepSpeed guide calls ``deepspeed.initialize`` inside ``train_loop_per_worker`` and checkpoints
through Ray Train's API; this script does just that with ``import dslaunch as deepspeed`` (or
``import deepspeed`` with dslaunch's compat distribution installed). Ray Train has made the process
group before the loop runs: ``initialize`` uses it.

    python scripts/examples/ray_train.py --num_workers 2 --steps 8        # Ray Train's TorchTrainer
    dslaunch --num_gpus 2 scripts/examples/ray_train.py --steps 8         # the same loop, launched
    dslaunch --launcher ray --ray_address auto scripts/examples/ray_train.py --steps 8   # on Ray nodes

Options for tests: ``--losses FILE`` (rank 0 appends one JSON line per step: step, loss, world, time),
``--ckpt DIR --save_every K`` (checkpoint every K steps), ``--load DIR --load_tag TAG`` (resume from
that checkpoint), ``--sleep S`` (seconds per step), ``--fail_at K`` (the last rank raises at step K in a run that
started from step 0: a fault for Ray Train's restart), ``--phases FILE`` (rank 0 appends when its process started, had
imported torch and the engine, and had initialized and loaded: a restart's breakdown), ``--max_failures N`` (Ray Train's restarts), ``--min_workers N``
(Ray Train's elastic worker group).
"""

import argparse
import json
import os
import tempfile
import time

import torch
from torch import nn

import dslaunch as deepspeed

IMPORTED_AT = time.time()  # torch and the engine imported (a warm spare had them before the run)

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
          "dist_init_timeout": 60}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x[:, :4] * 2 - 1 + 0.1 * torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def train_loop_per_worker(config: dict) -> None:
    """One worker's loop; ``config``: the parsed options as a dict. Under Ray Train it reports
    each checkpoint with ``ray.train.report`` and resumes from ``ray.train.get_checkpoint()``."""
    in_ray = config["trainer"]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=Pairs(), config=CONFIG)
    if in_ray:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as path:
                engine.load_checkpoint(path)
    elif config["load"]:
        engine.load_checkpoint(config["load"], tag=config["load_tag"])
    rank0 = engine.global_rank == 0
    fail_at = config["fail_at"] if engine.global_steps == 0 and engine.global_rank == engine.world_size - 1 else 0
    if rank0:
        print(f"world={engine.world_size} resumed_at={engine.global_steps}", flush=True)
        if config["phases"]:
            _phases(config["phases"], initialized=time.time())
    while engine.global_steps < config["steps"]:
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            step = engine.global_steps
            if rank0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
                if config["losses"]:
                    with open(config["losses"], "a") as f:
                        f.write(json.dumps({"step": step, "loss": loss.item(), "world": engine.world_size,
                                            "t": time.time()}) + "\n")
            if config["save_every"] and step % config["save_every"] == 0:
                _save(engine, config, step, in_ray)
            if step == fail_at:
                raise RuntimeError(f"--fail_at {fail_at}: the injected fault")
            time.sleep(config["sleep"])
            if step >= config["steps"]:
                break


def _phases(path: str, **times: float) -> None:
    """One JSON line: this process's start, its imports done, and ``times``."""
    import psutil

    record = {"pid": os.getpid(), "started": psutil.Process().create_time(), "imported": IMPORTED_AT, **times}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _save(engine, config: dict, step: int, in_ray: bool) -> None:
    if not in_ray:
        engine.save_checkpoint(config["ckpt"])
        return
    import ray.train
    import torch.distributed as dist

    # Every rank saves into one directory all ranks see (dslaunch's checkpoints are published by
    # rank 0 from a shared directory: a rank's own temporary directory, as in Ray's guide, would
    # leave its shards unpublished); rank 0 reports it, Ray Train copies it into its storage.
    path = os.path.join(config["storage"], "shared", f"step{step}")
    engine.save_checkpoint(path)
    dist.barrier()
    checkpoint = ray.train.Checkpoint.from_directory(path) if engine.global_rank == 0 else None
    ray.train.report({"step": step}, checkpoint=checkpoint)


def _trainer(config: dict):
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        ray.init(address=config["ray_address"], include_dashboard=False)
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=config,
        # (min, max): Ray Train's elastic group, restarted with as many workers as fit
        scaling_config=ScalingConfig(num_workers=(config["min_workers"], config["num_workers"])
                                     if config["min_workers"] else config["num_workers"],
                                     use_gpu=torch.cuda.is_available()),
        run_config=RunConfig(name="ray_train", storage_path=config["storage"],
                             failure_config=FailureConfig(max_failures=config["max_failures"])))
    return trainer.fit()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--num_workers", type=int, default=2, help="Ray Train's workers (TorchTrainer only)")
    p.add_argument("--min_workers", type=int, default=0,
                   help="TorchTrainer only: elastic, ScalingConfig(num_workers=(MIN, --num_workers))")
    p.add_argument("--ray_address", default=None, help="TorchTrainer only: the cluster to join (default: local)")
    p.add_argument("--storage", default=None,
                   help="TorchTrainer only: RunConfig(storage_path=...), a directory every node sees")
    p.add_argument("--max_failures", type=int, default=0, help="TorchTrainer only: FailureConfig(max_failures=...)")
    p.add_argument("--losses", default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--save_every", type=int, default=0)
    p.add_argument("--load", default=None)
    p.add_argument("--load_tag", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--phases", default=None)
    p.add_argument("--fail_at", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    config = vars(p.parse_args())
    # Started by a launcher (dslaunch, deepspeed, torchrun): run the loop here; else Ray Train runs it.
    config["trainer"] = "RANK" not in os.environ
    config["storage"] = os.path.abspath(config["storage"] or tempfile.mkdtemp())
    if config["trainer"]:
        _trainer(config)
    else:
        train_loop_per_worker(config)


if __name__ == "__main__":
    main()
