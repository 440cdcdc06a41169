"""ALST's tiling (``deepspeed.runtime.sequence_parallel.ulysses_sp``): ``TiledMLP``,
``sequence_tiled_compute`` and ``TiledFusedLogitsLoss`` give the outputs and gradients of the
untiled computation, for lengths the slice count does not divide, under a loss multiplied after
the call (fp16 loss scaling's case) and inside the engine at ZeRO 1-3, where a weight's gradient is
reduced only once every slice has added to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from tests.distributed import run_world

HIDDEN, VOCAB = 8, 11


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(HIDDEN, 3 * HIDDEN), torch.nn.Linear(3 * HIDDEN, HIDDEN)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


def _mlp_forward(module: MLP, x: torch.Tensor) -> torch.Tensor:
    return module.plain(x)


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def _fresh(module: torch.nn.Module, x: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("batch", "length", "shards"), [(1, 12, 4), (2, 10, 4), (2, 9, 4), (3, 5, 1)])
def test_tiled_mlp_gives_the_untiled_outputs_and_gradients(batch: int, length: int, shards: int) -> None:
    torch.manual_seed(0)
    mlp = MLP().double()
    x = torch.randn(batch, length, HIDDEN, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(batch, length, HIDDEN, dtype=torch.float64)
    want_out = mlp.plain(x)
    (want_out * weight).sum().backward()
    want = _grads(mlp, x)
    _fresh(mlp, x)
    out = TiledMLP.apply(_mlp_forward, mlp, x, shards, list(mlp.parameters()))
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    (out * weight).sum().backward()
    _assert_close(_grads(mlp, x), want)
    assert all(p.ds_grad_is_ready for p in mlp.parameters())  # left whole after the last slice


@pytest.mark.parametrize(("dim", "reduction"), [(1, None), (1, "mean"), (1, "sum"), (0, "mean"), (0, "sum")])
def test_sequence_tiled_compute_reduces_and_back_propagates_as_the_untiled_computation(dim: int, reduction: str | None) -> None:
    torch.manual_seed(1)
    mlp = MLP().double()
    x = torch.randn(2, 10, HIDDEN, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(3.0, dtype=torch.float64)
    shards = 4  # 10 positions: slices of 3, 3, 3, 1

    def fn(hidden: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        out = mlp.plain(hidden) * factor
        return out.square().mean() if dim == 0 else out

    def untiled() -> torch.Tensor:
        if dim == 0:  # one loss per slice, then reduced over the slices
            per_slice = torch.stack([fn(x[:, s:s + 3], scale) for s in range(0, 10, 3)])
            return per_slice.mean() if reduction == "mean" else per_slice.sum()
        out = fn(x, scale)
        return out if reduction is None else out.mean() if reduction == "mean" else out.sum()

    want_out = untiled()
    (want_out.sum() * 7).backward()
    want = _grads(mlp, x)
    _fresh(mlp, x)
    out = sequence_tiled_compute(fn, 10, shards, {"hidden": x}, {"factor": scale}, "hidden",
                                 list(mlp.parameters()), dim, reduction)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    (out.sum() * 7).backward()
    _assert_close(_grads(mlp, x), want)


def _loss_fn(head: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    losses = F.cross_entropy(head(x).view(-1, VOCAB), y.view(-1), reduction="none")
    return (losses * mask).sum() if mask is not None else losses.sum()


@pytest.mark.parametrize("masked", [False, True])
def test_tiled_fused_logits_loss_is_exact_under_a_loss_scale(masked: bool) -> None:
    """Every gradient, the head's weight's included, follows a factor applied after the call (fp16
    loss scaling multiplies the loss so): DeepSpeed 0.19.8 scales only the input's gradient."""
    torch.manual_seed(2)
    head = torch.nn.Linear(HIDDEN, VOCAB).double()
    x = torch.randn(2, 7, HIDDEN, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, VOCAB, (2, 7))
    mask = (torch.rand(2, 7) > 0.3).double() if masked else None
    want_out = _loss_fn(head, x.view(14, HIDDEN), y.view(14), None if mask is None else mask.view(14))
    (want_out * 1024).backward()
    want = _grads(head, x)
    _fresh(head, x)
    out = TiledFusedLogitsLoss.apply(_loss_fn, head, x, y, mask, 3, list(head.parameters()), "sum")
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    (out * 1024).backward()
    _assert_close(_grads(head, x), want)


def test_bad_arguments_are_one_line() -> None:
    head, x = torch.nn.Linear(HIDDEN, VOCAB), torch.randn(2, 7, HIDDEN)
    with pytest.raises(UsageError, match="output_reduction 'avg' is not 'mean' or 'sum'"):
        TiledFusedLogitsLoss.apply(_loss_fn, head, x, torch.zeros(2, 7, dtype=torch.long), None, 2, [], "avg")
    with pytest.raises(UsageError, match=r"x \(2, 7, 8\) and y \(2, 6\) must both be"):
        TiledFusedLogitsLoss.apply(_loss_fn, head, x, torch.zeros(2, 6, dtype=torch.long), None, 2, [], "mean")
    with pytest.raises(UsageError, match="grad_requiring_tensor_key 'h' is not one of kwargs_to_shard's keys"):
        sequence_tiled_compute(lambda x: x, 7, 2, {"x": x}, {}, "h")
    with pytest.raises(UsageError, match="shards must be at least 1"):
        TiledMLP.apply(_mlp_forward, MLP(), x, 0, [])


class TinyLM(torch.nn.Module):
    """Embedding, an MLP block and a head; ``tiled``: the MLP and the logits + loss in slices."""

    def __init__(self, tiled: bool) -> None:
        super().__init__()
        self.tiled, self.tok, self.mlp = tiled, torch.nn.Embedding(VOCAB, HIDDEN), MLP()
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        if not self.tiled:
            h = h + self.mlp.plain(h)
            return _loss_fn(self.head, h, labels) / labels.numel()
        h = h + TiledMLP.apply(_mlp_forward, self.mlp, h, 3, list(self.mlp.parameters()))
        return TiledFusedLogitsLoss.apply(_loss_fn, self.head, h, labels, None, 4, list(self.head.parameters()),
                                          "sum") / labels.numel()


def _train(rank: int, world: int, stage: int, tiled: bool) -> list[float]:
    import dslaunch as deepspeed
    from dslaunch.runtime.zero.full_state import safe_get_full_fp32_param

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 64},
              "gradient_clipping": 1.0, "steps_per_print": 1000}
    engine, _, _, _ = deepspeed.initialize(model=TinyLM(tiled), config=config)
    losses = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, VOCAB, (2, 13), generator=g)
        loss = engine(ids, torch.roll(ids, -1, dims=1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses + [float(safe_get_full_fp32_param(p).sum()) for p in engine.module.parameters()]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tiled_model_trains_as_the_untiled_one_under_zero(stage: int) -> None:
    """Small reduce buckets with overlap: a weight's gradient reduced after its first slice would
    leave the later slices' parts out of the average (ZeRO-3: released between slices)."""
    plain = run_world(_train, 2, stage, False, timeout=150)
    tiled = run_world(_train, 2, stage, True, timeout=150)
    for got, want in zip(tiled, plain, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (got, want)
