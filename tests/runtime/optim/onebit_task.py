"""A small language-model task for the 1-bit optimizers: next-token prediction on a fixed Markov chain.

Every rank builds the same model and the same global batches; rank r trains on its slice of each.
``train`` runs an engine and returns the held-out loss at the end, the training losses and the
whole fp32 weights after chosen steps (for bitwise comparisons).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

VOCAB, DIM, SEQ, GLOBAL = 24, 32, 12, 16


class TinyLM(torch.nn.Module):
    """Embedding, one causal pre-norm transformer block, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.block = torch.nn.TransformerEncoderLayer(DIM, 2, dim_feedforward=64, dropout=0.0,
                                                      batch_first=True, norm_first=True)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ - 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(tokens[:, :-1]), src_mask=self.mask, is_causal=True)
        logits = self.head(h).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def sequences(count: int, seed: int) -> torch.Tensor:
    """``count`` sequences of a fixed sparse Markov chain (each token has 3 likely successors)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 0.5
    logits.scatter_add_(1, torch.randint(0, VOCAB, (VOCAB, 3), generator=g), torch.full((VOCAB, 3), 4.0))
    probs = logits.softmax(dim=1)
    g.manual_seed(seed)
    out = torch.empty(count, SEQ, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB, (count,), generator=g)
    for i in range(1, SEQ):
        out[:, i] = torch.multinomial(probs[out[:, i - 1]], 1, generator=g).squeeze(1)
    return out


def config(optimizer: dict, stage: int = 0, **extra: Any) -> dict:
    return {"train_batch_size": GLOBAL, "optimizer": optimizer, "steps_per_print": 10_000,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000},
            "gradient_clipping": 0.0, **extra}  # compared with torch's optimizers, which do not clip


def linear_decay(lr: float, steps: int) -> dict:
    """Config keys for ``lr`` decaying linearly to 0 over ``steps`` (DeepSpeed's ``WarmupDecayLR``,
    which decays to ``warmup_min_lr``; its one warm-up step, the first, runs at lr 0)."""
    return {"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": steps, "warmup_num_steps": 1, "warmup_min_lr": 0.0, "warmup_max_lr": lr,
        "warmup_type": "linear"}}}


def weights(engine: Any) -> torch.Tensor:
    """The whole fp32 weights, flat (every rank the same)."""
    from dslaunch.utils import safe_get_full_fp32_param

    return torch.cat([safe_get_full_fp32_param(p).reshape(-1).clone() for p in engine.module.parameters()])


def run_steps(engine: Any, rank: int, world: int, first: int, last: int, seed: int = 0) -> list[float]:
    """Steps [first, last): batch i is the i-th global batch (of data ``seed``); the global mean loss of each."""
    micro = GLOBAL // world
    losses = []
    for step in range(first, last):
        batch = sequences(GLOBAL, seed=1000 + step + 100_000 * seed)[rank * micro:(rank + 1) * micro]
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def held_out_loss(engine: Any, count: int = 64) -> float:
    with torch.no_grad():
        return float(engine.module(sequences(count, seed=7)))


def build(cfg: dict, seed: int = 0) -> Any:
    import dslaunch

    torch.manual_seed(seed)
    engine, _, _, _ = dslaunch.initialize(model=TinyLM(), config=cfg)
    return engine


def train(rank: int, world: int, cfg: dict, steps: int, snapshots: tuple[int, ...] = (), seed: int = 0,
          held_out: int = 64) -> dict:
    """Train ``steps`` steps (model and data from ``seed``); the loss on ``held_out`` held-out sequences,
    the losses and the weights after each step in ``snapshots``."""
    engine = build(cfg, seed)
    out: dict[str, Any] = {"weights": {}, "losses": []}
    done = 0
    for stop in sorted({*snapshots, steps}):
        out["losses"] += run_steps(engine, rank, world, done, stop, seed)
        done = stop
        if stop in snapshots:
            out["weights"][stop] = weights(engine).numpy().copy()
    out["held_out"] = held_out_loss(engine, held_out)
    engine.destroy()
    return out
