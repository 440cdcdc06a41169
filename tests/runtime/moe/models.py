"""A tiny MoE network for the distributed tests, built the same way at every expert-parallel size.

Expert ``g`` (global index) gets the same weights whichever rank holds it, so a run at ep 2 or 4
can be compared with a one-process run that holds every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dslaunch.moe.layer import MoE

HIDDEN, EXPERTS, TOKENS, CLASSES = 8, 4, 16, 3


@dataclass(frozen=True)
class MoECase:
    k: int
    use_residual: bool
    drop_tokens: bool

    @property
    def label(self) -> str:
        return f"top{self.k}{'-residual' if self.use_residual else ''}{'-drop' if self.drop_tokens else ''}"


CASES = [MoECase(k, residual, drop) for k in (1, 2) for residual in (False, True) for drop in (False, True)]


class TinyMoENet(torch.nn.Module):
    """Linear, MoE, Linear; ``forward(x, y)`` is the cross-entropy loss plus 0.01 * ``l_aux``."""

    def __init__(self, case: MoECase, ep_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Tanh(),
                                     torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=case.k, min_capacity=2,
                       use_residual=case.use_residual, drop_tokens=case.drop_tokens, use_rts=False,
                       top2_2nd_expert_sampling=False)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_expert_weights(self, first_global: int) -> None:
        """Local expert ``j`` gets global expert ``first_global + j``'s weights."""
        with torch.no_grad():
            for j, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                gen = torch.Generator().manual_seed(100 + first_global + j)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(self.inp(x))
        self.last = (out.detach(), l_aux.detach())
        return torch.nn.functional.cross_entropy(self.head(out), y) + 0.01 * l_aux


def batch(rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens at ``step``: skewed toward a few directions so experts overfill."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen) * 1.5 + torch.linspace(-1, 1, HIDDEN) * 2
    return x, torch.randint(0, CLASSES, (TOKENS,), generator=gen)


def clipped_losses(model: TinyMoENet, stage: int, data_rank: int, steps: int, mpu: object = None) -> list[float]:
    """``steps`` steps of ``model`` through ``deepspeed.initialize`` (SGD with momentum, ZeRO
    ``stage``, gradient clipping at 0.05, which must act), on data rank ``data_rank``'s batches;
    the losses."""
    import dslaunch as deepspeed
    from dslaunch.moe.utils import split_params_into_different_moe_groups_for_optimizer

    params = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})
    config = {"train_micro_batch_size_per_gpu": TOKENS, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
              "gradient_clipping": 0.05, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config, mpu=mpu)
    losses, clipped = [], 0
    for step in range(steps):
        loss = engine(*batch(data_rank, step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        clipped += engine.get_global_grad_norm() > 0.05
    assert clipped, "the clip never acted: raise the learning rate or lower gradient_clipping"
    return losses


def expert_index(name: str, first_global: int) -> str:
    """``name`` of a local expert parameter renamed to its global expert index."""
    head, sep, tail = name.partition("deepspeed_experts.")
    if not sep:
        return name
    local, _, rest = tail.partition(".")
    return f"{head}{sep}{first_global + int(local)}.{rest}"


def starving_model() -> TinyMoENet:
    """A top-1 ep-2 net whose routing is forced: expert 0 takes the even ranks' tokens (of
    ``starving_batch``), expert 1 the odd ranks'; experts 2 and 3 (both on expert rank 1) get none."""
    model = TinyMoENet(MoECase(1, False, False), ep_size=2)
    with torch.no_grad():
        model.inp.weight.copy_(torch.eye(HIDDEN))
        model.inp.bias.zero_()
        wg = model.moe.deepspeed_moe.gate.wg.weight
        wg.zero_()
        wg[0, 0], wg[1, 0], wg[2, 1], wg[3, 1] = 10.0, -10.0, -10.0, -10.0
    return model


def starving_batch(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens for ``starving_model``: feature 0 says which expert takes them."""
    gen = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen) * 0.01
    x[:, 0], x[:, 1] = 1.0 if rank % 2 == 0 else -1.0, 1.0
    return x, torch.randint(0, CLASSES, (TOKENS,), generator=gen)


def starving_counts(rank: int) -> list[int]:
    """The tokens per expert ``starving_model`` routes from ``rank``."""
    return [0, TOKENS, 0, 0] if rank % 2 else [TOKENS, 0, 0, 0]


def train_starving(rank: int, world: int, steps: int, timeout_s: float = 1800.0) -> dict:
    """``steps`` ZeRO-3 steps of ``starving_model`` (SGD, ``timeout_s`` on every collective: a
    rank left waiting raises instead of hanging). Returns the per-expert token counts of the
    first and last step, every loss and the loop's wall time."""
    import datetime
    import time

    import dslaunch as deepspeed
    from dslaunch.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=timeout_s), verbose=False)
    model = starving_model()
    params = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})
    config = {"train_micro_batch_size_per_gpu": TOKENS, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    counts, losses = [], []
    start = time.perf_counter()
    for step in range(steps):
        loss = engine(*starving_batch(rank, world, step))
        engine.backward(loss)
        engine.step()
        if step in (0, steps - 1):
            counts.append(model.moe.deepspeed_moe.exp_counts.tolist())
        losses.append(loss.item())
    return {"counts": counts, "losses": losses, "wall_s": time.perf_counter() - start}
