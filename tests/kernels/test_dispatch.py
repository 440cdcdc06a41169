"""``dslaunch.kernels.get``: fused where registered and available, else the reference; the
``DSLAUNCH_KERNELS`` override; and the engine's optimizer updates really go through it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dslaunch import kernels
from dslaunch.errors import UsageError
from dslaunch.kernels import dispatch
from dslaunch.kernels.cpu import build
from dslaunch.kernels.dispatch import Kernel, KernelTable
from dslaunch.kernels.reference import torch_step


def _ref(*args, **kwargs) -> str:
    return "reference"


def _fused(*args, **kwargs) -> str:
    return "fused"


def _table(*fused: Kernel) -> KernelTable:
    return KernelTable(reference={"op": _ref}, fused={"op": fused})


def test_fused_only_for_its_device_type_and_when_available() -> None:
    table = _table(Kernel(_fused, ("cuda",)))
    assert table.get("op", torch.device("cuda", 1)) is _fused
    assert table.get("op", "cuda:0") is _fused
    assert table.get("op", torch.device("cpu")) is _ref
    assert _table(Kernel(_fused, ("cpu",), available=lambda: False)).get("op", "cpu") is _ref
    assert _table(Kernel(_fused, ("cpu",), available=lambda: True)).get("op", "cpu") is _fused
    assert KernelTable(reference={"op": _ref}).get("op", "cpu") is _ref  # nothing registered


def test_modes_reference_and_fused() -> None:
    table = _table(Kernel(_fused, ("cpu",)))
    assert table.get("op", "cpu", "reference") is _ref
    assert table.get("op", "cpu", "fused") is _fused
    with pytest.raises(UsageError, match="DSLAUNCH_KERNELS=fused: no fused 'op' kernel runs on 'cuda'"):
        table.get("op", "cuda", "fused")
    with pytest.raises(UsageError, match="unknown kernel op 'nope'; known: op"):
        table.get("nope", "cpu")


def test_targets_by_name_are_imported_on_use() -> None:
    table = KernelTable(reference={"op": "dslaunch.kernels.reference:torch_step"},
                        fused={"op": (Kernel("tests.kernels.test_dispatch:_fused", ("cpu",),
                                             available="tests.kernels.test_dispatch:_available"),)})
    assert table.get("op", "cpu") is _fused
    assert table.get("op", "cpu", "reference") is torch_step


def _available() -> bool:
    return True


def test_the_env_var_picks_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "KERNELS", _table(Kernel(_fused, ("cpu",))))
    monkeypatch.delenv("DSLAUNCH_KERNELS", raising=False)
    assert kernels.mode() == "auto" and kernels.get("op", "cpu") is _fused
    monkeypatch.setenv("DSLAUNCH_KERNELS", " Reference ")
    assert kernels.get("op", "cpu") is _ref
    monkeypatch.setenv("DSLAUNCH_KERNELS", "fused")
    assert kernels.get("op", "cpu") is _fused
    monkeypatch.setenv("DSLAUNCH_KERNELS", "fast")
    with pytest.raises(UsageError, match="DSLAUNCH_KERNELS='fast' is not one of auto, reference, fused"):
        kernels.get("op", "cpu")


def test_the_cpu_kernels_are_registered_and_every_op_has_a_reference() -> None:
    on_cpu = {op for op, ks in dispatch.KERNELS.fused.items() if any("cpu" in k.device_types for k in ks)}
    assert on_cpu == {"adam", "cpu_adam", "lion", "adagrad", "torch.adam", "torch.adamw", "torch.adagrad",
                      "onebit_pack", "onebit_unpack"}
    for op in dispatch.KERNELS.reference:
        assert callable(dispatch.KERNELS.get(op, "cpu"))
    with pytest.raises(UsageError, match="no fused 'torch.sgd' kernel"):
        dispatch.KERNELS.get("torch.sgd", "cpu", "fused")
    with pytest.raises(UsageError, match="no fused 'torch.adamw' kernel runs on 'cuda'"):
        dispatch.KERNELS.get("torch.adamw", "cuda", "fused")


def test_importing_the_kernels_imports_no_torch() -> None:
    code = "import sys, dslaunch.kernels; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- the engine goes through it

CALLS: list[tuple[str, object]] = []


def _spy(op: str):
    reference = dispatch.KERNELS.get(op, "cpu", "reference")

    def fused(*args, **kwargs):
        CALLS.append((op, args[0]))
        return reference(*args, **kwargs)
    return fused


def _train(optimizer: dict, model=None) -> tuple[object, list[torch.Tensor]]:
    import dslaunch
    from tests.runtime.models import batches, make_model

    cfg = {"train_batch_size": 4, "steps_per_print": 1000, "optimizer": optimizer,
           "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}}
    engine, _, _, _ = dslaunch.initialize(model=model or make_model(), config=cfg, dist_init_required=False)
    for tokens, labels in batches(2, 4):
        engine.backward(engine(tokens, labels))
        engine.step()
    return engine, [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op, optimizer", [
    ("torch.adamw", {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}),
    ("adam", {"type": "Adam", "params": {"lr": 1e-2, "bias_correction": False}}),
    ("lion", {"type": "Lion", "params": {"lr": 1e-3}}),
    ("torch.sgd", {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}),
])
def test_the_engine_step_calls_through_the_dispatch(op: str, optimizer: dict,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSLAUNCH_KERNELS", "reference")
    _, want = _train(optimizer)
    table = KernelTable(dispatch.KERNELS.reference, {op: (Kernel(_spy(op), ("cpu", "cuda")),)})
    monkeypatch.setattr(dispatch, "KERNELS", table)
    monkeypatch.setenv("DSLAUNCH_KERNELS", "fused")
    CALLS.clear()
    engine, got = _train(optimizer)
    assert len(CALLS) == 2 and all(c[0] == op for c in CALLS)  # once per optimizer step
    if op.startswith("torch."):
        assert all(c[1] is engine.optimizer.optimizer for c in CALLS)  # the torch one, inside the ZeRO wrapper
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


class _Mlp(torch.nn.Module):
    """No parameter with a zero gradient in exact arithmetic (as attention's key bias has): such a
    parameter's Adam update is m / sqrt(v) of rounding noise, which turns ulps into 1e-4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.hidden, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(tokens).mean(dim=1)))
        return torch.nn.functional.cross_entropy(self.head(h), labels)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not build.available(), reason="no C compiler: nothing fused on CPU")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine puts the model on the GPU here: no C kernel "
                    "runs (tests/gpu covers the Triton ones)")
@pytest.mark.parametrize("op, optimizer", [
    ("torch.adamw", {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}),
    ("torch.adam", {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01, "adam_w_mode": False}}),
    ("adam", {"type": "Adam", "params": {"lr": 1e-2, "bias_correction": False}}),
    ("lion", {"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.1}}),
    ("torch.adagrad", {"type": "Adagrad", "params": {"lr": 1e-2, "lr_decay": 0.01}}),
])
def test_the_engine_trains_the_same_with_the_cpu_kernels(op: str, optimizer: dict,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSLAUNCH_KERNELS", "reference")
    _, want = _train(optimizer, _Mlp())
    monkeypatch.setenv("DSLAUNCH_KERNELS", "fused")  # fails unless the C kernel serves the op
    assert kernels.get(op, "cpu").__module__.startswith("dslaunch.kernels.cpu.")
    _, got = _train(optimizer, _Mlp())
    assert any(not torch.equal(a, b) for a, b in zip(got, _Mlp().parameters(), strict=True))  # it trained
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
