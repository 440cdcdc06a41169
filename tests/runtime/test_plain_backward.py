"""A script's own ``loss.backward()`` on what the engine's forward returned: the accumulation steps
divide each path from the loss to the parameters once (``runtime/plain_backward.py``)."""

from __future__ import annotations

import pytest
import torch

import dslaunch
from tests.distributed import one_rank

GAS = 4


class _LossAndLogits(torch.nn.Module):
    """Returns its loss and the logits the loss was computed from, as a Hugging Face model's
    ``ModelOutput`` does (a dict), and the logits a second time in a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        logits = self.proj(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        return {"loss": loss, "logits": logits, "hidden_states": (logits, logits)}


def _engine(gas: int = 1) -> dslaunch.DeepSpeedEngine:
    torch.manual_seed(0)
    return dslaunch.initialize(model=_LossAndLogits(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10_000,
        "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]


def _grads(use: str) -> list[torch.Tensor]:
    engine = _engine(GAS)
    model = engine.module
    x, y = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 2])
    out = engine(x, y)
    if use == "engine":
        engine.backward(out["loss"] + out["logits"].pow(2).mean())
    else:
        (out["loss"] + out["hidden_states"][1].pow(2).mean()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.timeout(60)
@one_rank
def test_a_loss_returned_beside_its_logits_is_divided_once() -> None:
    # the loss's gradient reaches the logits through the model's own graph: not divided there again
    plain, engine = _grads("plain"), _grads("engine")
    for a, b in zip(plain, engine, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.manual_seed(0)
    reference = _LossAndLogits()
    x, y = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 2])
    out = reference(x, y)
    ((out["loss"] + out["logits"].pow(2).mean()) / GAS).backward()
    for a, p in zip(plain, reference.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(60)
@one_rank
def test_outputs_keep_their_structure_and_allow_in_place_use() -> None:
    engine = _engine()
    out = engine(torch.randn(2, 4), torch.tensor([0, 1]))
    assert isinstance(out, dict) and isinstance(out["hidden_states"], tuple)
    assert out["hidden_states"][0] is out["hidden_states"][1] is out["logits"]  # one tensor stays one
    out["logits"].mul_(2)  # no copy was made, and the caller may still write into it
    with torch.no_grad():
        assert not engine(torch.randn(2, 4), torch.tensor([0, 1]))["logits"].requires_grad


@pytest.mark.timeout(60)
@one_rank
def test_scale_takes_only_a_scalar_loss() -> None:
    from dslaunch.errors import NotALossError

    engine = _engine()
    out = engine(torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(AssertionError, match=r"scalar tensor with grad_fn, got a tensor of shape \(2, 3\)"):
        engine.scale(out["logits"])
    with pytest.raises(NotALossError, match="without one"):
        engine.scale(torch.tensor(1.0))
    engine.scale(out["loss"]).backward()  # a loss is taken
