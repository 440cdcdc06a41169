"""The peak bytes of the tensors an engine holds across training steps: what the estimator is
checked against (the tests here, ``scripts/bench/estimate_bench.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def engine_peak(model: Any, config: dict, batch: Callable[[Any], Any], steps: int = 2, private: bool = False,
                on_start: Callable[[Any], None] | None = None) -> int:
    """Build an engine over ``model`` with ``config``, train ``steps`` steps on ``batch(dtype)``
    (loss: the mean square of the output) and return the most bytes it held: sampled before each
    Linear's forward, at each Linear weight's gradient and after each step. With ``private``, not
    the storages in shared-memory segments (the host holds those once, in ``/dev/shm``).
    ``on_start(engine)`` runs once the engine is built.

    collective: call on all ranks.
    """
    import torch

    import dslaunch
    from tests.runtime.zero.held import held_bytes, shared_segments

    engine, *_ = dslaunch.initialize(model=model, config=config)
    if on_start is not None:
        on_start(engine)
    shared = [(lo, hi) for _, lo, hi in shared_segments()] if private else []
    samples: list[int] = []

    def sample(*_: object) -> None:
        samples.append(held_bytes(engine, outside=shared))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(sample)
            m.weight.register_hook(sample)
    dtype = next(p.dtype for p in model.parameters())
    for _ in range(steps):
        engine.backward(engine(batch(dtype)).float().square().mean())
        engine.step()
        sample()
    engine.destroy()
    return max(samples)


def activation_peak(engine: Any, batch: Any) -> tuple[int, int]:
    """(peak, held after forward): bytes of the tensors one forward + backward of ``engine`` on
    ``batch`` creates, alive at once, less those that outlive the backward (the gradients, which
    the estimate counts with the model states). One step runs first, so the optimizer state and
    the gradient buffers exist before the measured one. ``engine(batch)`` must return the loss.
    """
    from dslaunch.runtime.activation_checkpointing.memory import measure_step

    engine.backward(engine(batch))
    engine.step()
    m = measure_step(engine, batch)
    return m.peak - m.after_backward, m.held_after_forward


class ActivationModels:
    """A GPT-like model and a residual-MLP model of given dimensions (dropout 0.1, fp32), each
    block through ``deepspeed.checkpointing.checkpoint`` when ``checkpoint`` is set; ``shape``
    is the ``ModelShape`` the estimator gets for them."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
        self.layers, self.hidden, self.heads, self.seq, self.vocab = layers, hidden, heads, seq, vocab

    def shape(self, attention: bool) -> Any:
        import torch

        from dslaunch.runtime.estimate import from_module

        with torch.device("meta"):
            counted = from_module(self.build(attention))
        return counted.with_dims(hidden=self.hidden, layers=self.layers, heads=self.heads,
                                 vocab=self.vocab if attention else None, attention=attention)

    def build(self, attention: bool) -> Any:
        import torch
        from torch import nn
        from torch.nn import functional as F

        from dslaunch import checkpointing

        d, heads, seq, vocab = self.hidden, self.heads, self.seq, self.vocab

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
                self.drop = nn.Dropout(0.1)
                if attention:
                    self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if attention:
                    b, t, _ = x.shape
                    q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2)
                               for z in self.qkv(self.ln1(x)).split(d, -1))
                    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
                return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))

        class Model(nn.Module):
            def __init__(self, layers: int) -> None:
                super().__init__()
                self.blocks = nn.ModuleList(Block() for _ in range(layers))
                self.checkpoint = False
                if attention:
                    self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq, d))
                    self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
                else:
                    self.head = nn.Linear(d, 1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = self.emb(x) + self.pos if attention else x
                for block in self.blocks:
                    h = checkpointing.checkpoint(block, h) if self.checkpoint else block(h)
                if attention:
                    return F.cross_entropy(self.head(self.ln(h)).flatten(0, 1), x.roll(-1, 1).flatten())
                return self.head(h).square().mean()

        return Model(self.layers)

    def batch(self, attention: bool, micro_batch: int) -> Any:
        import torch

        g = torch.Generator().manual_seed(micro_batch)
        if attention:
            return torch.randint(0, self.vocab, (micro_batch, self.seq), generator=g)
        return torch.randn(micro_batch, self.seq, self.hidden, generator=g)


def measure_activations(models: ActivationModels, micro_batches: tuple[int, ...]) -> list[dict]:
    """Each model x checkpointing x micro batch on one engine (ZeRO 0, AdamW): the measured peak
    and held-after-forward bytes (``activation_peak``). Call in a 1-rank world."""
    import torch

    import dslaunch
    from dslaunch import checkpointing

    checkpointing.configure(None)
    rows = []
    for attention in (True, False):
        torch.manual_seed(0)
        model = models.build(attention)
        engine, *_ = dslaunch.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
        for ckpt in (False, True):
            model.checkpoint = ckpt
            for mb in micro_batches:
                peak, held = activation_peak(engine, models.batch(attention, mb))
                rows.append({"model": "gpt" if attention else "mlp", "checkpointing": ckpt, "micro_batch": mb,
                             "peak": peak, "held_after_forward": held})
        engine.destroy()
    return rows
