"""DualPipeV against real DeepSpeed 0.19.8 (the venv of ``test_deepspeed_interop``; skipped without
it): ``deepspeed_dualpipev_job.py`` (a ``DualPipeVModule`` of six layers, 2 ranks, ZeRO-1, AdamW)
trains to the same losses under both, and its checkpoints go both ways: dslaunch continues
DeepSpeed's tag, and DeepSpeed continues dslaunch's (``checkpoint.format: "deepspeed"``), each with
the losses of DeepSpeed continuing its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_dualpipev_job as job
from tests.runtime.checkpoint.test_deepspeed_interop import _deepspeed_job

pytestmark = pytest.mark.timeout(600)

SAVE_AT, STEPS = 6, 3
SCRIPT = Path(job.__file__)


def _deepspeed(python: Path, base: Path, name: str, **args) -> list[dict]:
    return _deepspeed_job(python, base / f"{name}.json", base / "ext", 2, {"stages": 2, **args}, script=SCRIPT)


@pytest.fixture(scope="module")
def deepspeed_runs(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> tuple[Path, list[dict], list[dict]]:
    """DeepSpeed's tag after ``SAVE_AT`` steps, its results up to there, and its own continuation."""
    base = tmp_path_factory.mktemp("deepspeed-dualpipev")
    first = _deepspeed(deepspeed_python, base, "first", first=0, steps=SAVE_AT, save=str(base / "ck"))
    then = _deepspeed(deepspeed_python, base, "then", first=SAVE_AT, steps=STEPS, load=str(base / "ck"))
    return base / "ck", first, then


def _run(rank: int, world: int, args: dict) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, stages=2, **args)


def test_the_same_losses_and_weights_as_deepspeed(deepspeed_runs, tmp_path: Path) -> None:
    _, theirs, _ = deepspeed_runs
    ours = run_world(_run, 2, {"first": 0, "steps": SAVE_AT}, timeout=240)
    for a, b in zip(ours, theirs, strict=True):
        assert a["type"] == b["type"] == "DualPipeVEngine"
        assert a["losses"] == pytest.approx(b["losses"], rel=0, abs=1e-6)
        assert a["weights"].keys() == b["weights"].keys()  # the same stages on the same ranks
        for name, values in a["weights"].items():
            assert values == pytest.approx(b["weights"][name], rel=0, abs=1e-6), name


def test_checkpoints_go_both_ways(deepspeed_runs, deepspeed_python: Path, tmp_path: Path) -> None:
    folder, _, then = deepspeed_runs
    want = then[0]["losses"]
    ours = run_world(_run, 2, {"first": SAVE_AT, "steps": STEPS, "load": str(folder)}, timeout=240)
    assert all(r["losses"] == pytest.approx(want, rel=0, abs=1e-6) for r in ours)
    saved = tmp_path / "ours"
    run_world(_run, 2, {"first": 0, "steps": SAVE_AT, "save": str(saved), "checkpoint": {"format": "deepspeed"}},
              timeout=240)
    theirs = _deepspeed(deepspeed_python, tmp_path, "load", first=SAVE_AT, steps=STEPS, load=str(saved))
    assert all(r["losses"] == pytest.approx(want, rel=0, abs=1e-6) for r in theirs)
