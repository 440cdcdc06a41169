"""``deepspeed.checkpointing`` on a CUDA device: the CUDA generator is replayed (gradients bit for
bit, dropout through the fused ``native_dropout``, both modes), and ``cpu_checkpointing`` keeps
the inputs in pinned host memory, so the device holds less after the forward; so does ALST's offload
of checkpointed hidden states. Marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

from dslaunch.runtime.activation_checkpointing import checkpointing as ckpt
from tests.gpu.marks import NEEDS_CUDA
from tests.runtime.activation_checkpointing.blocks import Stack, tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    NEEDS_CUDA,
]


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt, "_STATE", ckpt._State())


def _grads(model: Stack) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.cuda.manual_seed(5)
    model(tokens().cuda()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("which", ["checkpoint", "non_reentrant_checkpoint"])
def test_cuda_gradients_are_bitwise_those_without_checkpointing(which: str, mode: str) -> None:
    torch.manual_seed(0)
    model = Stack().cuda()
    plain = _grads(model)
    ckpt.configure(None, mode=mode)
    model.wrap = getattr(ckpt, which)
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model), strict=True))


def test_cpu_checkpointing_moves_inputs_to_pinned_host_memory() -> None:
    ckpt.configure(None, checkpoint_in_cpu=True)
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    before = torch.cuda.memory_allocated()
    y = ckpt.checkpoint(lambda a: (a @ w).tanh(), x * 2)  # x * 2: only the checkpoint holds it
    kept = y.grad_fn.call.kept[0]
    assert kept.data.device.type == "cpu" and kept.data.is_pinned()
    assert torch.cuda.memory_allocated() - before == y.numel() * 4  # the output only
    y.sum().backward()
    assert torch.equal(w.grad, torch.autograd.grad(((x.detach() * 2) @ w).tanh().sum(), w)[0])


def test_checkpointed_hidden_states_offload_to_pinned_memory_frees_the_device() -> None:
    """ALST's offload context on CUDA: gradients bit for bit, and after the forward the device holds
    the newest layer's input only (the others wait in pinned host memory)."""
    from dslaunch.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
    from tests.runtime.activation_checkpointing.test_offload_activations import HIDDEN, LAYERS, SEQ
    from tests.runtime.activation_checkpointing.test_offload_activations import Stack as Layers

    torch.manual_seed(0)
    model = Layers().cuda()
    x = torch.randn(2, SEQ, 8, device="cuda")
    results = {}
    for name, ctx in (("plain", None), ("offload", CheckpointHiddenStatesOffload(min_offload_bytes=0))):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with ctx if ctx is not None else torch.enable_grad():
            loss = model(x)
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        results[name] = held, [p.grad.clone() for p in model.parameters()]
    one = 2 * SEQ * HIDDEN * 4
    assert results["plain"][0] - results["offload"][0] == (LAYERS - 1) * one
    assert all(torch.equal(a, b) for a, b in zip(results["plain"][1], results["offload"][1], strict=True))
