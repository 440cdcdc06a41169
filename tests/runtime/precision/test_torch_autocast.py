"""The ds_config's ``torch_autocast`` block: forwards (and pipeline stages) under ``torch.autocast``
with the weights kept in fp32, trained bit for bit as plain torch with the same autocast;
float16 scaled dynamically; bad blocks one line naming the key."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import ConfigError, UsageError
from tests.distributed import run_world


class _Recorder(torch.nn.Module):
    """Two linears around a GELU; records the dtype the first linear computed in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.dtypes.append(h.dtype)
        return self.b(torch.nn.functional.gelu(h)).float().square().mean()


def _config(dtype: str = "bfloat16", **autocast) -> dict:
    return {"train_batch_size": 4, "steps_per_print": 1000, "zero_optimization": {"stage": 0},
            "torch_autocast": {"enabled": True, "dtype": dtype, **autocast}}


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _reference(dtype: torch.dtype, steps: int) -> list[torch.Tensor]:
    model = _Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches(steps):
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train(rank: int, world: int, dtype: str) -> dict:
    import dslaunch

    model = _Recorder()
    engine, *_ = dslaunch.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=_config(dtype))
    out = {"scale": engine.loss_scale(), "getters": (engine.torch_autocast_enabled(), engine.torch_autocast_dtype(),
                                                     engine.torch_autocast_lower_precision_safe_modules())}
    for x in _batches(3):
        with torch.autocast("cpu", enabled=False):  # the config's autocast wins, as in DeepSpeed
            loss = engine(x)
        engine.backward(loss)
        engine.step()
    out["dtypes"] = list(model.dtypes)
    out["params"] = [(p.dtype, p.detach().tolist()) for p in model.parameters()]  # lists: results cross processes
    engine.eval()
    with torch.no_grad():
        engine(torch.zeros(4, 8))  # evaluation forwards autocast too
    out["eval"] = model.dtypes[-1]
    loss = engine(_batches(1)[0])
    try:
        loss.backward()  # float16 needs engine.scale(loss) first: the backward ends refusing it
    except UsageError as err:
        out["plain"] = str(err)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_forwards_autocast_and_train_as_torch_does(dtype: str) -> None:
    from dslaunch.runtime.torch_autocast import get_default_autocast_lower_precision_modules

    half = getattr(torch, dtype)
    (r,) = run_world(_train, 1, dtype, timeout=80)
    assert r["dtypes"] == [half] * 3 and r["eval"] == half
    assert r["getters"] == (True, half, get_default_autocast_lower_precision_modules())
    assert all(d == torch.float32 for d, _ in r["params"])
    if dtype == "bfloat16":  # no loss scale: the same bits as torch's own autocast loop
        assert r["scale"] == 1.0 and "plain" not in r
        for (_, got), want in zip(r["params"], _reference(half, 3), strict=True):
            assert got == want.tolist()
    else:  # scaled dynamically from 2**16; a plain loss.backward() cannot be
        assert r["scale"] == 2.0**16 and "engine.scale(loss).backward()" in r["plain"]
        for (_, got), want in zip(r["params"], _reference(half, 3), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def _stage_dtypes(rank: int, world: int) -> list:
    import dslaunch
    from dslaunch.pipe import LayerSpec, PipelineModule

    class Probe(torch.nn.Module):
        seen: list = []  # noqa: RUF012 (this process's)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            Probe.seen.append(x.dtype)
            return x

    dslaunch.init_distributed()
    specs = [LayerSpec(torch.nn.Linear, 8, 8), LayerSpec(Probe), LayerSpec(torch.nn.Linear, 8, 1), LayerSpec(Probe)]
    module = PipelineModule(specs, num_stages=2, loss_fn=lambda out, y: (out.float() - y).square().mean())
    engine, *_ = dslaunch.initialize(model=module, config={**_config(), "train_batch_size": 2,
                                                           "train_micro_batch_size_per_gpu": 2,
                                                           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    loss = engine.train_batch(iter([(torch.randn(2, 8), torch.zeros(2, 1))]))
    return [Probe.seen, float(loss)]


@pytest.mark.timeout(90)
def test_pipeline_stages_autocast() -> None:
    for seen, loss in run_world(_stage_dtypes, 2, timeout=80):
        assert seen == [torch.bfloat16] and loss == loss  # each stage's linear ran in bf16, the loss is a number


@pytest.mark.parametrize(("block", "key", "says"), [
    ({"enabled": True, "dtype": "float32"}, "torch_autocast.dtype", "bfloat16"),
    ({"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"}, "torch_autocast.lower_precision_safe_modules",
     "a list of module classes"),
    ({"enabled": True, "dtpye": "bf16"}, "torch_autocast.dtpye", "did you mean 'dtype'"),
])
def test_a_bad_block_is_one_line_naming_its_key(block: dict, key: str, says: str) -> None:
    from dslaunch.runtime.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 2, "torch_autocast": block}, 1)
    assert f"'{key}'" in str(err.value) and says in str(err.value)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16", "fp16", "half"])
def test_deepspeeds_dtype_spellings_are_read(spelling: str) -> None:
    from dslaunch.runtime.config import load_config

    dtype = load_config({"train_batch_size": 2, "torch_autocast": {"enabled": True, "dtype": spelling}}, 1).torch_autocast.dtype
    assert dtype == ("bfloat16" if "b" in spelling else "float16")


def test_safe_module_names_must_import() -> None:
    from dslaunch.runtime.torch_autocast import get_comm_dtype, safe_module_classes

    assert safe_module_classes(["torch.nn.Linear", "torch.nn.Embedding"]) == (torch.nn.Linear, torch.nn.Embedding)
    with pytest.raises(ConfigError, match="torch_autocast.lower_precision_safe_modules.*torch.nn.Linaer does not import"):
        safe_module_classes(["torch.nn.Linaer"])
    with pytest.raises(ConfigError, match="is not a torch.nn.Module class"):
        safe_module_classes(["torch.float16"])
    # gradients are reduced in the parameters' own dtype (see runtime/torch_autocast.py)
    assert get_comm_dtype(torch.nn.Linear(2, 2).weight) == torch.float32
