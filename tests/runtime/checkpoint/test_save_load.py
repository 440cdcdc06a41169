"""Engine checkpoints end to end on gloo: bitwise resume, resharding, fallback, async, node-local."""

from __future__ import annotations

import importlib.util
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dslaunch.errors import CheckpointError, TagMismatchError
from tests.distributed import run_world
from tests.runtime.models import make_model

STEPS = 20


def _options(stage: int | str) -> tuple[int, list[str]]:
    level, *opts = str(stage).split("-")
    return int(level), opts


def _gas(stage: int | str) -> int:
    return next((int(o[3:]) for o in _options(stage)[1] if o.startswith("gas")), 1)


def _config(stage: int | str, **checkpoint) -> dict:
    """``stage`` is 0-2, optionally with "-bf16" (bf16 model, fp32 masters) and/or "-gasN"."""
    level, opts = _options(stage)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": _gas(stage),
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 8}},
            "zero_optimization": {"stage": level}, "steps_per_print": 10_000,
            "dataloader_drop_last": True, "bf16": {"enabled": "bf16" in opts},
            "checkpoint": checkpoint}


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randint(0, 32, (60, 6), generator=g),
                                          torch.randint(0, 4, (60,), generator=g))


def _engine(stage: int, seed: int, **checkpoint):
    import dslaunch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    engine, _, loader, _ = dslaunch.initialize(model=make_model(seed), training_data=_dataset(),
                                               config=_config(stage, **checkpoint))
    return engine, loader


def _train(engine, loader, steps: int) -> list[float]:
    """Train ``steps`` steps; python, numpy and torch RNG all feed the loss, so a resume that
    did not restore every RNG stream (or the data position) cannot match."""
    losses = []
    while len(losses) < steps:
        for tokens, labels in loader:
            noise = 1 + 0.1 * (random.random() + float(np.random.rand()) + torch.rand(()).item())
            loss = engine(tokens, labels) * noise
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


def _np(t: torch.Tensor) -> np.ndarray:
    # numpy, not tensors: torch sends tensors between processes through shared memory that
    # vanishes when the rank exits.
    return t.detach().float().numpy().copy()


def _summary(engine, losses: list[float]) -> dict:
    zero = engine.zero.state_dict()
    return {"losses": losses, "module": {k: _np(v) for k, v in engine.module.state_dict().items()},
            "zero": [{"master": _np(g["master"]), "start": g["start"], "end": g["end"],
                      "numel": g["numel"],
                      "optim": {k: _np(v) for k, v in g["optim_state"].items()},
                      "scalars": {k: float(v) for k, v in g["optim_scalars"].items()}}
                     for g in zero["groups"]],
            "engine": {k: v for k, v in engine.engine_state_dict().items() if k != "lr_scheduler"},
            "lr": engine.get_lr()}


def _straight(rank: int, world: int, stage: int) -> dict:
    engine, loader = _engine(stage, seed=0)
    # Two loops, as the resumed run has: each new loader iterator draws from the global torch RNG
    # (torch's DataLoader seeds its workers that way).
    losses = _train(engine, loader, STEPS // 2)
    return _summary(engine, losses + _train(engine, loader, STEPS // 2))


def _straight_then_first_half(rank: int, world: int, stage: int, root: str, checkpoint: dict) -> dict:
    """Both runs in one world (saves a process start): the second engine starts from scratch."""
    straight = _straight(rank, world, stage)
    _first_half(rank, world, stage, root, checkpoint)
    return straight


def _first_half(rank: int, world: int, stage: int, root: str, checkpoint: dict) -> dict:
    engine, loader = _engine(stage, seed=0, **checkpoint)
    _train(engine, loader, STEPS // 2)
    summary = _summary(engine, [])
    engine.save_checkpoint(root, client_state={"rank": rank, "t": torch.arange(3)})
    if checkpoint.get("async_save"):
        _train(engine, loader, 3)  # mutate everything while the background thread writes
        from dslaunch.runtime.checkpoint import wait_for_checkpoint

        wait_for_checkpoint(engine)
    return summary


def _second_half(rank: int, world: int, stage: int, root: str, tag: str | None) -> dict:
    engine, loader = _engine(stage, seed=99)  # different weights and RNG: the load must fix all
    path, client = engine.load_checkpoint(root, tag=tag)
    assert path is not None and path.endswith(f"global_step{STEPS // 2 // _gas(stage)}"), path
    loaded = _summary(engine, [])
    assert client["rank"] == (rank if rank < 2 else 0) or world != 2
    assert torch.equal(client["t"], torch.arange(3))
    return {"loaded": loaded, **_summary(engine, _train(engine, loader, STEPS // 2))}


def _assert_same(a: dict, b: dict) -> None:
    for k in a["module"]:
        assert np.array_equal(a["module"][k], b["module"][k]), k
    for ga, gb in zip(a["zero"], b["zero"], strict=True):
        assert np.array_equal(ga["master"], gb["master"])
        assert ga["optim"].keys() == gb["optim"].keys()
        for k in ga["optim"]:
            assert np.array_equal(ga["optim"][k], gb["optim"][k]), k
        assert ga["scalars"] == gb["scalars"]
    assert a["engine"] == b["engine"] and a["lr"] == b["lr"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,checkpoint", [(0, {}), ("1-bf16", {}), (2, {}), (2, {"async_save": True}),
                                              ("2-gas2", {})])
def test_resume_is_bitwise_identical(tmp_path: Path, stage: int, checkpoint: dict) -> None:
    straight = run_world(_straight_then_first_half, 2, stage, str(tmp_path), checkpoint)
    resumed = run_world(_second_half, 2, stage, str(tmp_path), None)
    for s, r in zip(straight, resumed, strict=True):
        assert r["losses"] == s["losses"][STEPS // 2:]
        _assert_same(s, r)


def _full(summaries: list[dict], key: str | None) -> list[np.ndarray]:
    """Concatenate the ranks' shards of each group into [0, numel) (stage 0: rank 0's copy)."""
    out = []
    for gi in range(len(summaries[0]["zero"])):
        parts = sorted((s["zero"][gi] for s in summaries), key=lambda g: g["start"])
        numel, pos, pieces = parts[0]["numel"], 0, []
        for g in parts:
            t = g["master"] if key is None else g["optim"][key]
            if g["end"] > pos:
                pieces.append(t[pos - g["start"]:])
                pos = g["end"]
        full = np.concatenate(pieces)
        assert full.size == numel
        out.append(full)
    return out


def _assert_same_consolidated(saved: list[dict], loaded: list[dict]) -> None:
    for key in (None, "exp_avg", "exp_avg_sq"):
        for a, b in zip(_full(saved, key), _full(loaded, key), strict=True):
            assert np.array_equal(a, b), key
    assert [g["scalars"] for g in saved[0]["zero"]] == [g["scalars"] for g in loaded[0]["zero"]]


def _load_elsewhere(rank: int, world: int, stage: int, root: str) -> dict:
    engine, loader = _engine(stage, seed=99)
    path, _ = engine.load_checkpoint(root)
    loaded = _summary(engine, [])
    losses = _train(engine, loader, 4)
    assert all(np.isfinite(losses))
    return {**loaded, "after": losses, "steps": engine.global_steps}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,stage_in,m,stage_out", [(4, 2, 2, 2), (2, 2, 3, 2), (2, 1, 3, 0)])
def test_load_at_another_world_size_and_stage(tmp_path: Path, n: int, stage_in: int, m: int,
                                              stage_out: int) -> None:
    saved = run_world(_first_half, n, stage_in, str(tmp_path), {})
    loaded = run_world(_load_elsewhere, m, stage_out, str(tmp_path))
    _assert_same_consolidated(saved, loaded)
    assert all(r["steps"] == STEPS // 2 + 4 for r in loaded)
    for r in loaded:  # every rank of the new world holds the same full model
        for k, v in saved[0]["module"].items():
            assert np.array_equal(r["module"][k], v), k
    _check_fp32_export(tmp_path, saved[0]["module"])


def _check_fp32_export(root: Path, module: dict) -> None:
    """The offline export equals the fp32 model the saving world held (all ranks' shards)."""
    from dslaunch.launcher.cli import main as cli
    from dslaunch.runtime.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint

    for source in (root, root / "global_step10"):
        sd = get_fp32_state_dict_from_zero_checkpoint(source)
        assert list(sd) == list(module)
        for k, v in module.items():
            assert sd[k].dtype == torch.float32 and np.array_equal(sd[k].numpy(), v), k
    assert cli(["zero-to-fp32", str(root), str(root / "out" / "model.pt")]) == 0
    pt = torch.load(root / "out" / "model.pt")
    assert all(np.array_equal(pt[k].numpy(), v) for k, v in module.items())
    code = cli(["zero-to-fp32", str(root), str(root / "model.safetensors"), "--tag", "global_step10"])
    if importlib.util.find_spec("safetensors") is None:
        assert code == 2  # UsageError: install safetensors or write .pt
    else:
        from safetensors.torch import load_file

        st = load_file(str(root / "model.safetensors"))
        assert code == 0 and all(np.array_equal(st[k].numpy(), v) for k, v in module.items())


def test_zero_to_fp32_names_a_bad_directory(tmp_path: Path) -> None:
    from dslaunch.errors import CheckpointError
    from dslaunch.runtime.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nope'}: not a directory"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=f"{tmp_path}: no checkpoint here"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    (tmp_path / "global_step3").mkdir()
    with pytest.raises(CheckpointError, match="manifest is missing"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="global_step3")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fallback_and_errors(rank: int, world: int, root: str) -> list[str]:
    from dslaunch.errors import CheckpointError

    records = _Records()
    logging.getLogger("dslaunch.checkpoint").addHandler(records)
    engine, loader = _engine(2, seed=0)
    assert engine.load_checkpoint(os.path.join(root, "nothing")) == (None, None)
    _train(engine, loader, 2)
    engine.save_checkpoint(root)
    _train(engine, loader, 2)
    engine.save_checkpoint(root)
    torch.distributed.barrier()
    bad = Path(root) / "global_step4" / "zero_rank_00001.dsl"
    if rank == 0:
        with open(bad, "r+b") as f:
            f.seek(bad.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match=f"rank 1: {bad}: checksum mismatch"):
        engine.load_checkpoint(root, tag="global_step4")
    path, _ = engine.load_checkpoint(root)
    assert path.endswith("global_step2") and engine.global_steps == 2
    at2 = _summary(engine, [])
    from dslaunch.runtime.checkpoint import save_checkpoint

    with pytest.raises(CheckpointError, match="tags differ across ranks"):
        save_checkpoint(_fail_tags(engine.checkpoint_parts()), root, tag=f"t{rank}")
    engine.save_checkpoint(root, tag=f"w{rank}", save_latest=False)  # Warn: rank 0's tag wins
    assert (Path(root) / "w0" / "rank_00001.dsl").is_file() and not (Path(root) / "w1").exists()
    # Ignore: no check, no warning, still one directory (DeepSpeed's ranks would write two)
    with pytest.raises(TagMismatchError):  # also DeepSpeed's AssertionError
        save_checkpoint(_fail_tags(engine.checkpoint_parts()), root, tag=f"t{rank}")
    save_checkpoint(_tags(engine.checkpoint_parts(), "Ignore"), root, tag=f"i{rank}", save_latest=False)
    assert (Path(root) / "i0" / "rank_00001.dsl").is_file() and not (Path(root) / "i1").exists()
    _check_partial_loads(engine, loader, root, at2)
    assert engine.save_16bit_model(os.path.join(root, "export"))
    if rank == 0:
        exported = torch.load(os.path.join(root, "export", "pytorch_model.bin"))
        assert all(torch.equal(exported[k], v) for k, v in engine.module.state_dict().items())
    return records.lines


def _check_partial_loads(engine, loader, root: str, at2: dict) -> None:
    """load_optimizer_states / load_lr_scheduler_states / load_module_only keep what they say."""
    _train(engine, loader, 2)
    at4 = _summary(engine, [])
    sched4 = engine.lr_scheduler.state_dict()
    engine.load_checkpoint(root, tag="global_step2", load_optimizer_states=False,
                           load_lr_scheduler_states=False)
    now = _summary(engine, [])
    assert np.array_equal(now["zero"][0]["master"], at2["zero"][0]["master"])  # weights: step 2
    for k in now["zero"][0]["optim"]:  # moments: still those of step 4
        assert np.array_equal(now["zero"][0]["optim"][k], at4["zero"][0]["optim"][k]), k
    assert engine.global_steps == 2 and engine.lr_scheduler.state_dict() == sched4
    _train(engine, loader, 1)
    engine.load_checkpoint(root, tag="global_step2", load_module_only=True)
    now = _summary(engine, [])
    assert np.array_equal(now["zero"][0]["master"], at2["zero"][0]["master"])
    assert engine.global_steps == 3  # counters untouched
    assert not np.array_equal(now["zero"][0]["optim"]["exp_avg"], at2["zero"][0]["optim"]["exp_avg"])


def _tags(parts, policy: str):
    """The engine's checkpoint parts, with checkpoint.tag_validation = ``policy``."""
    import dataclasses

    return dataclasses.replace(parts, config=dataclasses.replace(parts.config, tag_validation=policy))


def _fail_tags(parts):
    return _tags(parts, "Fail")


@pytest.mark.timeout(60)
def test_nothing_to_load_fallback_and_named_corruption(tmp_path: Path) -> None:
    lines = run_world(_fallback_and_errors, 2, str(tmp_path))[0]
    assert any("no checkpoint to load" in line for line in lines)
    assert any("global_step4" in line and "checksum mismatch" in line and "loaded tag 'global_step2'"
               in line for line in lines)
    assert any("tags differ across ranks" in line and "rank 0's tag 'w0'" in line for line in lines)


def _node_local(rank: int, world: int, root: str, phase: str) -> dict:
    os.environ["NODE_RANK"] = str(rank)  # one node per rank, each with its own "disk"
    disk = os.path.join(root, f"node{rank}")
    engine, loader = _engine(2, seed=0 if phase == "save" else 99, use_node_local_storage=True)
    if phase == "save":
        _train(engine, loader, STEPS // 2)
        engine.save_checkpoint(disk)
        return {**_summary(engine, []), "files": sorted(os.listdir(os.path.join(disk, "global_step10")))}
    engine.load_checkpoint(disk)
    return _summary(engine, [])


@pytest.mark.timeout(60)
def test_node_local_storage_needs_no_shared_disk(tmp_path: Path) -> None:
    saved = run_world(_node_local, 2, str(tmp_path), "save")
    assert saved[1]["files"] == ["manifest.json", "module.dsl", "rank_00001.dsl", "zero_rank_00001.dsl"]
    loaded = run_world(_node_local, 2, str(tmp_path), "load")
    for s, r in zip(saved, loaded, strict=True):
        _assert_same(s, r)


def _node_local_elsewhere(rank: int, world: int, root: str) -> str:
    engine, _ = _engine(2, seed=99, use_node_local_storage=True)
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(os.path.join(root, "node0"))
    return str(err.value)


@pytest.mark.timeout(60)
def test_node_local_storage_at_another_world_size_names_what_is_missing(tmp_path: Path) -> None:
    run_world(_node_local, 2, str(tmp_path), "save")
    message = run_world(_node_local_elsewhere, 1, str(tmp_path))[0]
    assert "zero_rank_00001.dsl" in message, message


def _save_without_fsync(rank: int, world: int, root: str) -> tuple[int, list[float], list[float]]:
    fsyncs = []
    real = os.fsync
    os.fsync = lambda fd: (fsyncs.append(fd), real(fd))[1]
    try:
        engine, loader = _engine(2, seed=0, fsync=False)
        _train(engine, loader, 2)
        engine.save_checkpoint(root)
    finally:
        os.fsync = real
    fresh, _ = _engine(2, seed=99)
    fresh.load_checkpoint(root)
    weights = [p.detach().sum().item() for p in engine.module.parameters()]
    return len(fsyncs), weights, [p.detach().sum().item() for p in fresh.module.parameters()]


@pytest.mark.timeout(60)
def test_checkpoint_fsync_false_saves_a_loadable_tag_without_syncing(tmp_path: Path) -> None:
    fsyncs, saved, loaded = run_world(_save_without_fsync, 1, str(tmp_path))[0]
    assert fsyncs == 0
    assert loaded == saved
