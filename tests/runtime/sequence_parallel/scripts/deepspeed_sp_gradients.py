"""Real DeepSpeed's gradients on ``grad_model``'s loss paths at sequence-parallel size 2, against the
same samples trained whole in one process: the numbers docs/parallelism.md quotes.

Run with DeepSpeed's interpreter (``DS_ACCELERATOR=cpu``, the repository root as the working
directory): ``python tests/runtime/sequence_parallel/scripts/deepspeed_sp_gradients.py WORLD PATHS
STAGES CLIPS``, e.g. ``2 alst,vpce 0,1,2,3 0,0.6``. One line a case: the per-step least-squares
scale of the averaged gradient on the whole-sequence one, the largest residual and loss difference.
(``fpdt`` is not run: DeepSpeed's ``FPDT_Attention`` needs flash-attn; ``spl`` is dslaunch's own.)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.getcwd())
from tests.runtime.sequence_parallel.grad_model import MICRO, TinyLM, ratio, train_steps  # noqa: E402

STEPS = 3


def _rank(rank: int, world: int, port: int, how: str, sp: int, stage: int, clip: float, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = None
    if sp > 1:
        parallel_state_sp.initialize_sequence_parallel(sp)
        mpu = parallel_state_sp
    torch.manual_seed(0)
    model = TinyLM(how)
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000, "gradient_clipping": clip,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                           config=config, mpu=mpu)
    if sp > 1:
        model.connect("deepspeed", parallel_state_sp.get_sequence_parallel_group())
        sp_rank, replica = rank % sp, rank // sp
    else:
        sp_rank, replica = 0, rank
    losses, grads = train_steps(engine, how, replica, sp_rank, sp, STEPS, safe_get_full_grad)
    out.put((rank, replica, losses, grads))  # lists: a tensor would be shared through a descriptor
    deepspeed.comm.barrier()


def run(world: int, how: str, sp: int, stage: int, clip: float) -> list[tuple]:
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), 29500 + os.getpid() % 2000
    procs = [ctx.Process(target=_rank, args=(r, world, port, how, sp, stage, clip, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = [out.get(timeout=90) for _ in procs]
    for p in procs:
        p.join()
    return sorted(got)


def main() -> None:
    world, paths, stages, clips = sys.argv[1:5]
    for how in paths.split(","):
        for stage in map(int, stages.split(",")):
            for clip in map(float, clips.split(",")):
                reference = {r[1]: r for r in run(int(world) // 2, "whole", 1, stage, clip)}
                scales, residual, loss_err = [], 0.0, 0.0
                for _, replica, losses, grads in run(int(world), how, 2, stage, clip):
                    _, _, want_losses, want_grads = reference[replica]
                    for got, want in zip(grads, want_grads, strict=True):
                        scale, rest = ratio(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64))
                        scales.append(round(scale, 4))
                        residual = max(residual, rest)
                    loss_err = max(loss_err, *(abs(a - b) for a, b in zip(losses, want_losses, strict=True)))
                print(f"deepspeed {how} world {world} stage {stage} clip {clip} scales {scales} "
                      f"residual {residual:.2g} loss_err {loss_err:.2g}", flush=True)


if __name__ == "__main__":
    main()
