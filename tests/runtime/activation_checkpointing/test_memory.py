"""What checkpointing saves, measured (``LiveBytes``: bytes of the tensors created during forward +
backward, alive at once): full checkpointing keeps a fraction of the plain model's activations,
the non-reentrant checkpoint frees each recomputed block after its backward (as the reentrant one),
selective keeps more than full and less than none."""

from __future__ import annotations

import pytest
import torch

from dslaunch.runtime.activation_checkpointing import checkpointing as ckpt
from dslaunch.runtime.activation_checkpointing.memory import LiveBytes
from tests.runtime.activation_checkpointing.blocks import Stack, tokens

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt, "_STATE", ckpt._State())


def _peak(model: Stack, wrap: object, mode: str = "full") -> int:
    ckpt.configure(None, mode=mode)
    model.wrap = wrap
    ids = tokens(batch=4, t=32, vocab=32)
    model(ids).backward()  # warm: gradients exist, so the measured step allocates only activations
    with LiveBytes() as m:
        model(ids).backward()
    return m.peak


def test_checkpointing_cuts_peak_activation_memory() -> None:
    torch.manual_seed(0)
    model = Stack(layers=8, d=64)
    none = _peak(model, None)
    full = _peak(model, ckpt.checkpoint)
    non_reentrant = _peak(model, ckpt.non_reentrant_checkpoint)
    selective = _peak(model, ckpt.checkpoint, "selective")
    assert full < 0.5 * none
    assert non_reentrant <= 1.1 * full  # each recomputed block freed after its backward
    assert full < selective < none


def test_live_bytes_counts_until_freed() -> None:
    with LiveBytes() as m:
        a = torch.ones(1000)
        b = a.view(10, 100).t()  # a view: nothing new
        assert m.live == 4000 and b.shape == (100, 10)
        del a, b
        assert m.live == 0 and m.peak == 4000
