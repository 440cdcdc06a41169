"""Checkpoints real DeepSpeed 0.19.8 wrote, loaded by dslaunch (``deepspeed_load``).

Real DeepSpeed runs ``deepspeed_job.py`` in its own venv (``.venv-conformance/deepspeed``, which
``make conformance`` builds, or the interpreter ``DSLAUNCH_DEEPSPEED_PYTHON`` names), one process
per rank on gloo: 3 steps, a save, then 10 more steps (its own continuation). dslaunch loads that
checkpoint at the same or another world size and stage and runs the same 10 steps: the mean loss
of each step equals DeepSpeed's within 1e-6, and right after the load every parameter's fp32
master and Adam moments equal DeepSpeed's at the save, bit for bit. Without the venv these tests
skip and say why.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dslaunch.errors import CheckpointError
from dslaunch.utils.ports import free_port
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_job

ROOT = Path(__file__).resolve().parents[3]
JOB = Path(deepspeed_job.__file__)
SAVE_AT, STEPS = 3, 10


@pytest.fixture(scope="session")
def deepspeed_python() -> Path:
    """The interpreter of a venv with real DeepSpeed, or skip naming how to get one."""
    named = os.environ.get("DSLAUNCH_DEEPSPEED_PYTHON")
    python = Path(named) if named else ROOT / ".venv-conformance" / "deepspeed" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"real DeepSpeed is not installed ({python} is missing): build it with `make conformance` "
                    "or name an interpreter with DSLAUNCH_DEEPSPEED_PYTHON")
    return python


@pytest.fixture(scope="session")
def deepspeed_runs(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``run(stage, world, bf16=False)``: DeepSpeed's checkpoint folder and per-rank results,
    once per session (any op DeepSpeed builds goes to a private folder, never into its venv)."""
    base = tmp_path_factory.mktemp("deepspeed")
    cache: dict[tuple, tuple[Path, list[dict]]] = {}

    def run(stage: int, world: int, bf16: bool = False) -> tuple[Path, list[dict]]:
        key = (stage, world, bf16)
        if key not in cache:
            cache[key] = _run_deepspeed(deepspeed_python, base, base / "ext", stage, world, bf16)
        return cache[key]

    return run


def _run_deepspeed(python: Path, base: Path, ext: Path, stage: int, world: int, bf16: bool
                   ) -> tuple[Path, list[dict]]:
    name = f"z{stage}_w{world}{'_bf16' if bf16 else ''}"
    ckpt, out = base / name, base / f"{name}.json"
    args = json.dumps({"stage": stage, "first": 0, "steps": SAVE_AT + STEPS, "save": str(ckpt),
                       "save_at": SAVE_AT, "bf16": bf16})
    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(ext), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "PYTHONPATH": ""}
    procs = [subprocess.Popen([str(python), str(JOB), str(out), args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"DeepSpeed {name} did not finish in 400 s")
    if any(p.returncode for p in procs):
        pytest.fail(f"DeepSpeed {name} failed (exit codes {[p.returncode for p in procs]}):\n{logs[0][-3000:]}")
    return ckpt, [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def _continue(rank: int, world: int, stage: int, load: str, bf16: bool, load_kwargs: dict, probe: bool) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    out = deepspeed_job.run(dslaunch, rank, world, stage, first=SAVE_AT, steps=STEPS, load=load, bf16=bf16,
                            load_kwargs=load_kwargs, probe=probe)
    out["client"] = {k: v for k, v in out["client"].items() if isinstance(v, (int, str, float))}
    return out


def _dslaunch(stage: int, world: int, load: Path, bf16: bool = False, probe: bool = True,
              **load_kwargs: Any) -> list[dict]:
    return run_world(_continue, world, stage, str(load), bf16, load_kwargs, probe, timeout=240)


def _mean_losses(results: list[dict], skip: int = 0) -> list[float]:
    per_rank = [r["losses"][skip:] for r in results]
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("ds_stage", "ds_world", "stage", "world", "bf16"), [
    (1, 2, 1, 2, False), (1, 2, 1, 1, False), (2, 2, 2, 2, False), (2, 2, 2, 1, False), (3, 2, 3, 2, False),
    (3, 2, 3, 1, False),
    (2, 2, 3, 2, False),  # another stage
    (0, 2, 0, 2, False), (0, 2, 2, 1, False),  # no ZeRO: the client optimizer's own state dict
    (3, 4, 3, 4, False), (3, 4, 1, 2, False),
    (2, 2, 2, 2, True), (2, 2, 3, 1, True),  # bf16_zero_pp_rank_* files, fp32 masters in them
])
def test_dslaunch_continues_deepspeed(deepspeed_runs: Any, ds_stage: int, ds_world: int, stage: int,
                                      world: int, bf16: bool) -> None:
    folder, ds = deepspeed_runs(ds_stage, ds_world, bf16)
    got = _dslaunch(stage, world, folder, bf16)
    want = _mean_losses(ds, skip=SAVE_AT)
    have = _mean_losses(got)
    # bf16 at another world size sums other bf16 partial results: only the loaded state is exact
    if not bf16 or world == ds_world:
        assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < 1e-6, (want, have)
    first = got[0]
    assert first["path"] == str(folder / "global_step3" / ("zero_pp_rank_0_mp_rank_00_model_states.pt"
                                                           if ds_stage == 3 else "mp_rank_00_model_states.pt"))
    assert (first["global_steps"], first["global_samples"], first["skipped_steps"]) == (3, 24, 0)
    assert first["client"]["note"] == "from the job" and first["client"]["step"] == SAVE_AT
    if ds_stage and stage:  # masters and moments as DeepSpeed had them at the save, bit for bit
        assert first["state"] == ds[0]["state"]


@pytest.mark.timeout(600)
def test_flags_mean_what_deepspeeds_mean(deepspeed_runs: Any) -> None:
    folder, ds = deepspeed_runs(2, 2)
    module_only = _dslaunch(2, 1, folder, probe=False, load_module_only=True)[0]
    assert module_only["global_steps"] == 0 and module_only["lr"] == [0.0]  # no counters, no scheduler
    assert "note" in module_only["client"]
    no_optim = _dslaunch(2, 2, folder, probe=False, load_optimizer_states=False)
    # counters and the scheduler (WarmupLR at its 3rd step: log(3) / log(20) of the way up) loaded
    assert no_optim[0]["global_steps"] == 3 and no_optim[0]["lr"] == pytest.approx([0.01 * math.log(3) / math.log(20)])
    # fresh moments: the first step differs from DeepSpeed's continuation, the weights do not
    want = _mean_losses(ds, skip=SAVE_AT)
    assert abs(_mean_losses(no_optim)[0] - want[0]) < 1e-6  # the same weights give the same first loss
    assert abs(_mean_losses(no_optim)[1] - want[1]) > 1e-6  # a fresh Adam takes another step


def _load_once(rank: int, world: int, load: str) -> str:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    net = deepspeed_job.model()
    opt = torch.optim.AdamW(net.parameters())
    engine, *_ = dslaunch.initialize(model=net, optimizer=opt, config=deepspeed_job.config(2, world))
    try:
        engine.load_checkpoint(load)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.timeout(600)
def test_broken_deepspeed_checkpoints_name_the_file(deepspeed_runs: Any, tmp_path: Path) -> None:
    folder, _ = deepspeed_runs(2, 2)
    broken = tmp_path / "ck"
    shutil.copytree(folder, broken)
    optim = broken / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    msg = run_world(_load_once, 1, str(broken))[0]
    assert str(optim) in msg and "truncated" in msg, msg
    torch.save({"something": "else"}, optim)
    msg = run_world(_load_once, 1, str(broken))[0]
    assert str(optim) in msg and "'optimizer_state_dict' is missing" in msg, msg
    optim.unlink()
    msg = run_world(_load_once, 1, str(broken))[0]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in msg and "2 data-parallel ranks" in msg, msg
    model = broken / "global_step3" / "mp_rank_00_model_states.pt"
    model.write_bytes(b"not a checkpoint")
    msg = run_world(_load_once, 1, str(broken))[0]
    assert str(model) in msg, msg
    assert "\n" not in msg


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def _names(rank: int, world: int, stage: int, load: str) -> list[str]:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    net = deepspeed_job.model()
    engine, *_ = dslaunch.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()),
                                     config=deepspeed_job.config(stage, world))
    return [engine._get_ckpt_name(load, "global_step3"), engine._get_zero_ckpt_name(load, "global_step3"),
            engine._get_optimizer_ckpt_name(load, "global_step3", 0),
            engine._get_ckpt_name(load, "global_step3", mp_placeholder="*")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_name_helpers_name_deepspeeds_files(deepspeed_runs: Any, stage: int) -> None:
    folder, _ = deepspeed_runs(stage, 2)
    for rank, (model, zero, optim, pattern) in enumerate(run_world(_names, 2, stage, str(folder))):
        assert Path(model).is_file() and Path(zero).is_file(), (model, zero)
        assert Path(zero).name == f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        assert optim == str(folder / "global_step3" / "expp_rank_0_mp_rank_00_optim_states.pt")
        assert pattern.endswith("mp_rank_*_model_states.pt")
