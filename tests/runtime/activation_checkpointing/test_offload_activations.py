"""ALST's offload of checkpointed hidden states (``offload_activations``): a stack of layers that
checkpoint through torch's checkpoint (non-reentrant, as Hugging Face's; reentrant too) and mark
their input as transformers' layers do. Losses and gradients are bit for bit those without the
offload; after the forward the graph holds only the newest layer's input where it was made (the
others are host copies: the originals are freed); with the engine, ``cpu_checkpointing`` turns it on.
The real Hugging Face layer is tests/compat/test_ulysses.py's."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.utils.checkpoint

from dslaunch.errors import UsageError
from dslaunch.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload,
    active,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)
from tests.distributed import run_world

pytestmark = pytest.mark.timeout(60)
LAYERS, HIDDEN, SEQ = 4, 32, 64


class Layer(torch.nn.Module):
    """A pre-norm MLP block that checkpoints itself and marks its input as
    ``GradientCheckpointingLayer`` does under the offload context; ``inputs`` keeps weak references
    to what it was given."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, 64), torch.nn.Linear(64, HIDDEN)
        self.reentrant = reentrant
        self.inputs: list[weakref.ref] = []

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(weakref.ref(x))
        if active() is not None:
            active().mark(x)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


class Stack(torch.nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer(reentrant) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h.pow(2).mean()

    def resident_inputs(self) -> int:
        """Bytes of the layers' latest inputs still alive (held by the graph, nothing else)."""
        alive = [layer.inputs[-1]() for layer in self.layers]
        return sum(t.numel() * t.element_size() for t in alive if t is not None)


def _step(model: Stack, offload: CheckpointHiddenStatesOffload | None) -> tuple[float, list[torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    x = torch.randn(2, SEQ, 8, generator=torch.Generator().manual_seed(3))
    if offload is None:
        loss = model(x)
    else:
        with offload:
            loss = model(x)
    resident = model.resident_inputs()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], resident


@pytest.mark.parametrize("reentrant", [False, True])
def test_offload_keeps_results_and_drops_the_saved_inputs(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Stack(reentrant)
    loss, grads, resident = _step(model, None)
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0)
    loss_o, grads_o, resident_o = _step(model, offload)
    assert loss_o == loss and all(torch.equal(a, b) for a, b in zip(grads, grads_o, strict=True))
    one = 2 * SEQ * HIDDEN * 4
    assert resident == LAYERS * one and resident_o == one  # the newest layer's input stays (keep_last_count=1)
    s = offload.stats
    assert (s.marked_tensors, s.offloaded_tensors, s.kept_last_tensors) == (LAYERS, LAYERS - 1, 1)
    assert s.restored_tensors == LAYERS - 1 and s.offloaded_bytes == s.restored_bytes == (LAYERS - 1) * one


def test_thresholds_and_refusals() -> None:
    torch.manual_seed(0)
    model = Stack()
    small = CheckpointHiddenStatesOffload(min_offload_bytes=2 * SEQ * HIDDEN * 4 + 1, keep_last_count=0)
    assert _step(model, small)[2] == LAYERS * 2 * SEQ * HIDDEN * 4 and small.stats.skipped_marked_tensors == LAYERS
    none_kept = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0)
    assert _step(model, none_kept)[2] == 0 and none_kept.stats.offloaded_tensors == LAYERS
    with pytest.raises(UsageError, match=r"keep_last_count=-1\): must be an integer >= 0"):
        CheckpointHiddenStatesOffload(keep_last_count=-1)
    with none_kept, pytest.raises(UsageError, match="not re-entrant"):
        none_kept.__enter__()
    assert active() is None


def _engine_offloads(rank: int, world: int) -> tuple[int, int]:
    import dslaunch as deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"cpu_checkpointing": True}}
    engine, _, _, _ = deepspeed.initialize(model=Stack(), config=config)
    x = torch.randn(2, SEQ, 8)
    loss = engine(x)
    resident = engine.module.resident_inputs()
    engine.backward(loss)
    engine.step()
    plain, _, _, _ = deepspeed.initialize(model=Stack(), config={**config, "activation_checkpointing": {}})
    loss = plain(x)
    return resident, plain.module.resident_inputs()


def test_the_engine_offloads_under_cpu_checkpointing() -> None:
    """``activation_checkpointing.cpu_checkpointing: true`` opens the context around the engine's
    forward; backward runs after it closed."""
    assert run_world(_engine_offloads, 1, timeout=50) == [(2 * SEQ * HIDDEN * 4, LAYERS * 2 * SEQ * HIDDEN * 4)]
