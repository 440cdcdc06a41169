"""Pipeline checkpoints on real gloo ranks: each rank saves its part, named by its coordinates (one
file per layer); a restart at the same shape continues bit for bit; a tag loads at another
pipeline depth and data-parallel width with the same weights and optimizer state; ``zero_to_fp32``
makes one state dict of it; broken tags are one line naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dslaunch.errors import CheckpointError
from tests.distributed import run_world
from tests.runtime.pipe import helpers

pytestmark = pytest.mark.timeout(180)

HALF, MICRO_PER_STEP = 4, 4  # steps before and after the save; micro batches per step (all replicas)
SEED, OTHER_SEED = helpers.BASE_SEED, 99


def _out_proj(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, module.weight).sum(1, keepdim=True)


def _layers(blocks: int) -> list:
    """``helpers.layers(blocks)``; 0: the first layer's module used again, through its weight, as the
    last (a tied layer on both stages)."""
    from dslaunch.pipe import LayerSpec, TiedLayerSpec

    if blocks:
        return helpers.layers(blocks)
    w, lin = helpers.WIDTH, torch.nn.Linear
    return [TiedLayerSpec("proj", lin, w, w), LayerSpec(torch.nn.Tanh), LayerSpec(lin, w, w), LayerSpec(torch.nn.Tanh),
            TiedLayerSpec("proj", lin, w, w, forward_fn=_out_proj)]


def _engine(stages: int, world: int, zero: int, seed: int = SEED, blocks: int = 2, async_save: bool = False,
            virtual: int = 1, fp16: dict | None = None):
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(_layers(blocks), num_stages=stages, loss_fn=helpers.loss_fn, seed_layers=True,
                            base_seed=seed, virtual_stages=virtual, partition_method="parameters" if blocks else "uniform")
    gas = MICRO_PER_STEP // (world // stages)  # the same global batch at every shape
    cfg = helpers.config(gas, 0.01, optimizer={"type": "AdamW", "params": {"lr": 0.01}},
                         scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 6}},
                         zero_optimization={"stage": zero}, checkpoint={"async_save": async_save},
                         pipeline={"schedule": "interleaved" if virtual > 1 else "1f1b"}, **({"fp16": fp16} if fp16 else {}))
    engine, *_ = dslaunch.initialize(model=module, config=cfg)
    return engine


def _data(engine, first: int, steps: int):
    """This replica's micro batches of steps ``first`` .. ``first + steps - 1``."""
    dp, gas = engine.dp_world_size, engine.micro_batches
    replica = engine.grid.get_data_parallel_rank()
    for step in range(first, first + steps):
        yield from helpers.micro_batches(step, gas * dp)[replica * gas:(replica + 1) * gas]


def _train(engine, first: int, steps: int) -> list[float]:
    data = _data(engine, first, steps)
    return [engine.train_batch(data).item() for _ in range(steps)]


def _state(engine) -> dict:
    """Weights by name, and the ZeRO state by parameter (numpy: tensors die with the rank)."""
    zero = engine.zero.state_dict()
    return {"module": {k: v.float().numpy().copy() for k, v in engine.module_state_dict().items()},
            "zero": [{"names": list(g["names"]), "shapes": [tuple(x) for x in g["shapes"]], "master": g["master"].numpy().copy(), "range": (g["start"], g["end"]),
                      "optim": {k: v.numpy().copy() for k, v in g["optim_state"].items()},
                      "step": float(g["optim_scalars"].get("step", -1))} for g in zero["groups"]],
            "counters": {k: engine.engine_state_dict()[k] for k in ("global_steps", "micro_steps")},
            "lr": engine.get_lr(), "scaler": engine.loss_scaler.state_dict()}


def _save_runs(rank: int, world: int, root: str, shapes: list[tuple[int, ...]], async_save: bool = False,
               fp16: dict | None = None) -> dict:
    """The uninterrupted run of the first shape, then each shape's first half, saved under
    ``p<stages>z<zero>`` (``b<blocks>`` after it for other layers); ``fp16``: that section."""
    stages, zero = shapes[0][:2]
    engine = _engine(stages, world, zero, fp16=fp16)
    out = {"straight": _train(engine, 0, 2 * HALF), "saved": {}}
    for stages, zero, *blocks in shapes:
        engine = _engine(stages, world, zero, async_save=async_save, blocks=blocks[0] if blocks else 2, fp16=fp16)
        _train(engine, 0, HALF)
        state = _state(engine)
        name = f"p{stages}z{zero}" + (f"b{blocks[0]}" if blocks else "")
        engine.save_checkpoint(f"{root}/{name}")
        if async_save:
            _train(engine, HALF, 2)  # the state changes while the writer thread saves the snapshot
            engine.wait_for_checkpoint()
        out["saved"][name] = state
    return out


def _plain_and_back(world: int, root: str, saved: str) -> dict:
    """A data-parallel engine of the same layers (``nn.Sequential``) loads a pipeline tag and saves
    it; a 2-stage pipeline loads that plain tag."""
    import dslaunch

    torch.manual_seed(OTHER_SEED)
    model = torch.nn.Sequential(*(spec.build() for spec in helpers.layers()))
    cfg = helpers.config(MICRO_PER_STEP // world, 0.01, optimizer={"type": "AdamW", "params": {"lr": 0.01}},
                         scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 6}})
    plain, *_ = dslaunch.initialize(model=model, config=cfg)
    plain.load_checkpoint(f"{root}/{saved}")
    plain.save_checkpoint(f"{root}/plain")
    engine = _engine(2, world, 0, seed=OTHER_SEED)
    engine.load_checkpoint(f"{root}/plain")
    return {"plain": _state(plain), "pipe": _state(engine)}


def _resume_all(rank: int, world: int, root: str, jobs: list[tuple[int, int, str, int]],
                fp16: dict | None = None) -> dict:
    """Each job: a fresh engine at (stages, zero, layers' middle blocks) loads a tag and trains on,
    or reports the one line it was refused with; 0 stages: ``_plain_and_back``."""
    out = {}
    for job in jobs:
        stages, zero, saved, blocks, *virtual = job  # and the virtual stages, where given
        if stages == 0:
            out[job] = _plain_and_back(world, root, saved)
            continue
        # other weights: the load replaces them
        engine = _engine(stages, world, zero, seed=OTHER_SEED, blocks=blocks, virtual=virtual[0] if virtual else 1,
                         fp16=fp16)
        try:
            path, _ = engine.load_checkpoint(f"{root}/{saved}")
        except CheckpointError as err:
            out[job] = str(err)
            continue
        assert path is not None and path.endswith(f"global_step{HALF}")
        loaded = _state(engine)
        out[job] = {"loaded": loaded, "losses": _train(engine, HALF, HALF)}
    return out


def _tag(root: Path, name: str) -> Path:
    return root / name / f"global_step{HALF}"


def _broken_copies(root: Path) -> None:
    """A tag without one layer file, and one with a truncated ZeRO file."""
    for name, victim, damage in (("nolayer", "layer_02-model_states.dsl", lambda f: f.unlink()),
                                 ("truncated", "zero_pipe_01-data_00.dsl", lambda f: f.write_bytes(f.read_bytes()[:-9]))):
        shutil.copytree(root / "p2z0", root / name)
        damage(_tag(root, name) / victim)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict:
    """Saved at pipe=2 (ZeRO-0) and pipe=1 x 2 replicas (ZeRO-1); loaded (after a restart) at the
    same shape, the other shape, by a model with other layers, and from broken copies."""
    root = tmp_path_factory.mktemp("pipe_ckpt")
    saved = run_world(_save_runs, 2, str(root), [(2, 0), (1, 1), (2, 1, 0)], timeout=150)
    _broken_copies(root)
    jobs = [(2, 0, "p2z0", 2), (1, 1, "p2z0", 2), (2, 0, "p1z1", 2), (2, 0, "p2z0", 3), (2, 0, "nolayer", 2),
            (2, 0, "truncated", 2), (0, 0, "p2z0", 2), (2, 1, "p2z0", 2, 2), (1, 1, "p2z1b0", 0)]
    resumed = run_world(_resume_all, 2, str(root), jobs, timeout=150)
    return {"root": root, "saved": saved, "resumed": resumed}


def _assert_resumed_bitwise(saved: list[dict], resumed: list[dict], key: tuple) -> None:
    for s, r in zip(saved, resumed, strict=True):
        got = r[key]
        assert got["losses"] == s["straight"][HALF:]  # bit for bit
        before, after = s["saved"][key[2]], got["loaded"]
        assert before["counters"] == after["counters"] and before["lr"] == after["lr"]
        assert before["scaler"] == after["scaler"]
        for k, v in before["module"].items():
            assert np.array_equal(after["module"][k], v), k
        for g, h in zip(before["zero"], after["zero"], strict=True):
            assert np.array_equal(g["master"], h["master"]) and g["step"] == h["step"] > 0
            assert g["optim"].keys() == h["optim"].keys() == {"exp_avg", "exp_avg_sq"}
            assert all(np.array_equal(g["optim"][k], h["optim"][k]) for k in g["optim"])


def _expected_files(world: int, zero: int) -> set[str]:
    dp = world // 2
    zero_files = {f"zero_pipe_{p:02d}-data_{d:02d}.dsl" for p in range(2) for d in range(dp if zero else 1)}
    layer_files = {f"layer_{i:02d}-model_states.dsl" for i in range(8)}  # every module layer, Tanh too
    return zero_files | layer_files | {f"rank_{r:05d}.dsl" for r in range(world)} | {"manifest.json"}


def test_resume_at_pipe2_is_bitwise(world2: dict) -> None:
    _assert_resumed_bitwise(world2["saved"], world2["resumed"], (2, 0, "p2z0", 2))
    assert {p.name for p in _tag(world2["root"], "p2z0").iterdir()} == _expected_files(2, 0)


def test_resume_at_pipe2_with_2_replicas_at_zero1_is_bitwise_async_save_too(tmp_path: Path) -> None:
    saved = run_world(_save_runs, 4, str(tmp_path), [(2, 1)], True, timeout=150)
    resumed = run_world(_resume_all, 4, str(tmp_path), [(2, 1, "p2z1", 2)], timeout=150)
    _assert_resumed_bitwise(saved, resumed, (2, 1, "p2z1", 2))
    assert {p.name for p in _tag(tmp_path, "p2z1").iterdir()} == _expected_files(4, 1)


# Starts too high, so the first steps overflow and are skipped; grows back every 2 clean steps.
FP16 = {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 1}


def test_resume_at_pipe2_with_2_replicas_at_zero2_and_fp16_is_bitwise(tmp_path: Path) -> None:
    """ZeRO-2's gradient shards and fp16's loss scaler (scale, its window's count, the last
    overflow) on the data axis come back as saved; training goes on bit for bit."""
    saved = run_world(_save_runs, 4, str(tmp_path), [(2, 2)], False, FP16, timeout=150)
    resumed = run_world(_resume_all, 4, str(tmp_path), [(2, 2, "p2z2", 2)], FP16, timeout=150)
    _assert_resumed_bitwise(saved, resumed, (2, 2, "p2z2", 2))
    scaler = saved[0]["saved"]["p2z2"]["scaler"]
    assert scaler["last_overflow_iter"] >= 0 and scaler["cur_scale"] < 2.0**18, scaler  # it moved
    assert {p.name for p in _tag(tmp_path, "p2z2").iterdir()} == _expected_files(4, 2)


def _by_param(states: list[dict]) -> dict[str, dict[str, np.ndarray]]:
    """Every parameter's master and optimizer state, from the ranks' shards (any shape)."""
    pieces: dict[tuple, dict] = {}
    for state in states:
        for g in state["zero"]:
            for key in ("master", *g["optim"]):
                t = g["master"] if key == "master" else g["optim"][key]
                pieces.setdefault((tuple(g["names"]), key), {})[g["range"]] = t
    out: dict[str, dict[str, np.ndarray]] = {}
    for (names, key), ranges in pieces.items():
        flat = np.concatenate([ranges[r] for r in sorted(ranges)])
        shapes = next(g["shapes"] for s in states for g in s["zero"] if tuple(g["names"]) == names)
        offset = 0
        for name, shape in zip(names, shapes, strict=True):
            n = int(np.prod(shape))
            out.setdefault(name, {}).setdefault(key, flat[offset:offset + n])  # a tied copy: the lowest stage's
            offset += n
    return out


@pytest.mark.parametrize("job", [(1, 1, "p2z0", 2), (2, 0, "p1z1", 2), (2, 1, "p2z0", 2, 2)],
                         ids=["pipe2-to-pipe1x2dp", "pipe1x2dp-to-pipe2", "pipe2-to-2-virtual-stages-each"])
def test_a_tag_loads_at_another_pipeline_depth_and_data_width(world2: dict, job: tuple) -> None:
    """Weights and Adam's moments move bit for bit; training goes on as the uninterrupted run."""
    saved = [s["saved"][job[2]] for s in world2["saved"]]
    loaded = [r[job]["loaded"] for r in world2["resumed"]]
    before, after = _by_param(saved), _by_param(loaded)
    assert set(after) == set(before) and len(after) == 10  # 5 Linear layers
    for name, state in after.items():
        assert state.keys() == {"master", "exp_avg", "exp_avg_sq"}
        assert all(np.array_equal(state[k], before[name][k]) for k in state), name
    for r in loaded:
        assert r["counters"] == saved[0]["counters"] and r["lr"] == saved[0]["lr"]
        assert all(np.array_equal(v, saved[0 if job[2] == "p1z1" else _holder(saved, k)]["module"][k])
                   for k, v in r["module"].items())
    straight = world2["saved"][0]["straight"][HALF:]
    for r in world2["resumed"]:
        assert r[job]["losses"] == pytest.approx(straight, rel=0, abs=1e-5)


def test_a_pipeline_tag_loads_into_a_plain_engine_of_the_same_layers_and_back(world2: dict) -> None:
    saved = _by_param([s["saved"]["p2z0"] for s in world2["saved"]])
    got = [r[(0, 0, "p2z0", 2)] for r in world2["resumed"]]
    for side in ("plain", "pipe"):
        loaded = _by_param([g[side] for g in got])
        assert set(loaded) == set(saved)
        for name, state in loaded.items():
            assert state.keys() == {"master", "exp_avg", "exp_avg_sq"}
            assert all(np.array_equal(state[k], saved[name][k]) for k in state), (side, name)


def test_tied_layers_held_by_both_stages_load_at_one_stage(world2: dict) -> None:
    saved = [s["saved"]["p2z1b0"] for s in world2["saved"]]
    tied = [s["module"]["tied_modules.proj.weight"] for s in saved]
    assert np.array_equal(tied[0], tied[1])  # each stage saved its copy; the tied weight's are equal
    # (the bias is tied by module only: its gradient is not summed, so the lowest stage's is loaded)
    before = _by_param(saved)
    loaded = [r[(1, 1, "p2z1b0", 0)] for r in world2["resumed"]]
    after = _by_param([r["loaded"] for r in loaded])
    assert set(after) == set(before) == {"tied_modules.proj.weight", "tied_modules.proj.bias", "2.weight", "2.bias"}
    for name, state in after.items():
        assert all(np.array_equal(state[k], before[name][k]) for k in ("master", "exp_avg", "exp_avg_sq")), name
    assert all(np.isfinite(r["losses"]).all() for r in loaded)


def _holder(states: list[dict], key: str) -> int:
    return next(i for i, s in enumerate(states) if key in s["module"])


def test_zero_to_fp32_makes_one_state_dict_for_the_unpartitioned_model(world2: dict, tmp_path: Path) -> None:
    from dslaunch.launcher.cli import main as cli
    from dslaunch.runtime.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint

    saved = [s["saved"]["p2z0"] for s in world2["saved"]]
    sd = get_fp32_state_dict_from_zero_checkpoint(world2["root"] / "p2z0")
    model = torch.nn.Sequential(*(spec.build() for spec in helpers.layers()))  # no stages
    assert list(sd) == list(model.state_dict())
    model.load_state_dict(sd)
    for name, value in sd.items():
        assert np.array_equal(value.numpy(), saved[_holder(saved, name)]["module"][name]), name
    assert cli(["zero-to-fp32", str(world2["root"] / "p2z0"), str(tmp_path / "model.pt")]) == 0
    assert torch.load(tmp_path / "model.pt").keys() == sd.keys()


def test_refusals_are_one_line_naming_the_file_and_what_fits(world2: dict, capsys) -> None:
    from dslaunch.launcher.cli import main as cli

    got, root = world2["resumed"][0], world2["root"]
    other = got[(2, 0, "p2z0", 3)]
    assert other == (f"{_tag(root, 'p2z0')}: the checkpoint's PipelineModule has 8 layers, this one 10: build it from "
                     "the same 8 layers (any number of stages) (saved at pipe=2, data=1; this engine: pipe=2, data=1)")
    missing, truncated = got[(2, 0, "nolayer", 2)], got[(2, 0, "truncated", 2)]
    assert missing.endswith(f"{_tag(root, 'nolayer') / 'layer_02-model_states.dsl'}: file is missing")
    assert f"{_tag(root, 'truncated') / 'zero_pipe_01-data_00.dsl'}: file is truncated" in truncated
    for name, victim in (("nolayer", "layer_02-model_states.dsl"), ("truncated", "zero_pipe_01-data_00.dsl")):
        code = cli(["zero-to-fp32", str(root / name), str(root / "out.pt")])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and victim in err, err


def test_a_malformed_topology_record_is_one_line(world2: dict, tmp_path: Path) -> None:
    from dslaunch.runtime.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint
    from dslaunch.runtime.checkpoint.store import MANIFEST, Manifest

    tag = tmp_path / "p2z0" / f"global_step{HALF}"
    shutil.copytree(_tag(world2["root"], "p2z0"), tag)
    manifest = Manifest.from_json((tag / MANIFEST).read_text(), tag / MANIFEST)
    manifest.meta["model_parallel"]["parts"]["pipe_01"]["partition"] = {"stage": 0, "groups": [{"names": 3}]}
    (tag / MANIFEST).write_text(manifest.to_json())
    with pytest.raises(CheckpointError) as err:
        get_fp32_state_dict_from_zero_checkpoint(tag)
    assert str(err.value) == (f"{tag / MANIFEST}: not an engine checkpoint this dslaunch version reads: meta "
                              "'model_parallel' part 'pipe_01': partition group 0 is malformed")
