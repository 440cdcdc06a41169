"""``deepspeed_pipe_job``'s training job with a ``DualPipeVModule`` (DeepSpeed 0.19.8's DualPipeV):
the same six layers cut into ``2 * stages`` stages placed in a V, the same data, optimizer and
schedule, for real DeepSpeed (as a script, ``deepspeed_job.main``) and dslaunch (``run_world``)."""

from __future__ import annotations

from typing import Any

import torch

try:  # as a script its folder is on the path; as a module of the tests, the package
    import deepspeed_pipe_job as pipe_job
except ImportError:
    from tests.runtime.checkpoint import deepspeed_pipe_job as pipe_job


def run(deepspeed: Any, rank: int, world: int, stages: int, first: int, steps: int, load: str | None = None,
        save: str | None = None, checkpoint: dict | None = None) -> dict[str, Any]:
    """Train steps ``first``..``first + steps - 1`` (loading ``load`` before, saving into ``save``
    after); the losses and this rank's weights by name."""
    torch.manual_seed(1234)
    net = deepspeed.pipe.DualPipeVModule(pipe_job.layers(deepspeed), num_stages=stages, loss_fn=pipe_job.loss_fn,
                                         partition_method="uniform", base_seed=1234, seed_layers=True)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.01, betas=(0.9, 0.99),
                            weight_decay=0.01)
    dp = world // stages
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=pipe_job.config(dp, 1, checkpoint))
    if load is not None:
        engine.load_checkpoint(load)
    it = pipe_job.data(first, steps, dp, engine.grid.get_data_parallel_rank())
    out: dict[str, Any] = {"losses": [float(engine.train_batch(it)) for _ in range(steps)], "type": type(engine).__name__}
    if save is not None:
        engine.save_checkpoint(save)
    out["weights"] = {name: p.detach().reshape(-1).tolist() for name, p in engine.module.state_dict().items()}
    return out


if __name__ == "__main__":  # run as a script: its folder is on the path
    import deepspeed_job

    deepspeed_job.main(run)
