"""Every sequence-parallel loss path trains with the whole sequence's gradient.

``grad_model.TinyLM`` (one attention block, 32 tokens, 3 of them a prompt without labels) at
sequence-parallel size 2 under the engine, plain SGD (no Adam: its scale invariance would hide a
factor), 3 steps: per step the averaged gradient (``safe_get_full_grad``) equals that of the same
samples trained whole (world 1, or dp 2 for sp 2 x dp 2) to 1e-5 of its largest value, with a
least-squares scale of 1 within 1e-4; the losses too. Gradient clipping (below the true gradient's norm,
above half of it) is on in half the cases: a gradient of the wrong scale or a norm counted
wrongly over the sequence ranks would clip differently and change the next step's losses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.sequence_parallel.grad_model import MICRO, ratio

STEPS = 3


def train(rank: int, world: int, how: str, sp: int, stage: int, clip: float) -> dict[str, Any]:
    """Train ``grad_model.TinyLM`` ``STEPS`` steps; the per-step losses and full gradients."""
    import dslaunch as deepspeed
    from dslaunch.runtime.zero.full_state import safe_get_full_grad
    from dslaunch.utils import groups
    from tests.runtime.sequence_parallel.grad_model import TinyLM, train_steps

    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000, "gradient_clipping": clip,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_optimization": {"stage": stage}}
    if sp > 1:
        config["sequence_parallel_size"] = sp
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyLM(how)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    if sp > 1:
        model.connect("dslaunch", engine.seq_parallel_group)
    replica, sp_rank = groups._get_data_parallel_rank(), groups._get_sequence_parallel_rank()
    losses, grads = train_steps(engine, how, replica, sp_rank, sp, STEPS, safe_get_full_grad)
    return {"replica": replica, "losses": losses, "grads": grads}


def measure(how: str, world: int, sp: int, stage: int, clip: float) -> tuple[list[float], float, float]:
    """Per-step gradient scales of the sp run on the whole-sequence run, the largest residual
    after scaling, and the largest loss difference."""
    reference = {r["replica"]: r for r in run_world(train, world // sp, "whole", 1, stage, clip, timeout=120)}
    runs = run_world(train, world, how, sp, stage, clip, timeout=120)
    scales, residual, loss_err = [], 0.0, 0.0
    for run in runs:
        want = reference[run["replica"]]
        for got, ref in zip(run["grads"], want["grads"], strict=True):
            scale, rest = ratio(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64))
            scales.append(scale)
            residual = max(residual, rest)
        loss_err = max(loss_err, *(abs(a - b) for a, b in zip(run["losses"], want["losses"], strict=True)))
    return scales, residual, loss_err


# The whole-sequence gradient's norm is 0.93, 0.84, 0.75 at the 3 steps: clipping at 0.6 clips it
# every step but not half of it.
CLIP = 0.6
# (loss path, world, sp, stage, clip): every path, every stage, sp 2 x dp 2, clipping on in half
CASES = [
    ("alst", 2, 2, 1, CLIP), ("spl", 2, 2, 2, 0.0), ("fpdt", 2, 2, 1, CLIP), ("fpdt", 2, 2, 0, 0.0),
    ("fpdt", 4, 2, 3, CLIP), ("fpdt_loss", 2, 2, 2, 0.0), ("vspce", 2, 2, 3, CLIP), ("vpce", 4, 2, 2, CLIP),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("how", "world", "sp", "stage", "clip"), CASES)
def test_the_gradient_is_the_whole_sequences(how: str, world: int, sp: int, stage: int, clip: float) -> None:
    scales, residual, loss_err = measure(how, world, sp, stage, clip)
    assert all(abs(s - 1) < 1e-4 for s in scales), scales
    assert residual < 1e-5 and loss_err < 1e-5, (residual, loss_err)
