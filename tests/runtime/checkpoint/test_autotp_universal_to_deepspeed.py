"""dslaunch's own AutoTP tag, converted to the universal layout by dslaunch, loaded by real
DeepSpeed 0.19.8 at ``autotp_size`` 2 (``checkpoint.load_universal``).

dslaunch runs ``deepspeed_tp_job.py`` at tensor-parallel degree 2 on 2 or 4 gloo ranks (1 or 2
replicas; ZeRO 1, 2 and 3): 3 steps, a save in its own format, 3 more (its own continuation).
``convert`` writes the universal folder; real DeepSpeed (the venv of ``test_deepspeed_interop``)
loads it at tp 2 with the same or the other number of replicas and runs the same 3 steps: each
loss equals dslaunch's continuation within 1e-6 (measured: equal at one replica, 2.4e-7 across
replica counts), the counters are the saved ones, and a run from the initial weights differs by
more than 1e-3. dslaunch's own ``load_universal`` of the same folder continues alike.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.deepspeed_reference import run_python
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_tp_job as job
from tests.runtime.checkpoint.test_deepspeed_interop import _deepspeed_job

pytestmark = pytest.mark.timeout(600)

SAVE_AT, STEPS = 3, 3


def _train(rank: int, world: int, save: str, stage: int) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, 2, first=0, steps=SAVE_AT + STEPS, stage=stage, save=save,
                   save_at=SAVE_AT, probe=False)


def _continue_universal(rank: int, world: int, load: str | None, stage: int) -> dict:
    """The steps after the save from the universal folder ``load`` (None: from the initial weights)."""
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, 2, first=SAVE_AT, steps=STEPS, stage=stage, load=load,
                   checkpoint={"load_universal": True}, probe=False)


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("stage", "saved", "loaded"), [(1, 2, 2), (2, 2, 4), (3, 4, 2)],
                         ids=["zero1-tp2", "zero2-tp2-to-tp2xdp2", "zero3-tp2xdp2-to-tp2"])
def test_deepspeed_continues_dslaunchs_autotp_tag_converted_to_universal(
        deepspeed_python: Path, tmp_path: Path, stage: int, saved: int, loaded: int) -> None:
    """``saved``/``loaded``: the world sizes (tensor-parallel degree 2; 4 ranks: 2 replicas)."""
    from dslaunch.runtime.checkpoint.universal import convert

    env = {**os.environ, "PYTHONPATH": os.environ.get("DSLAUNCH_DEEPSPEED_PYTHONPATH", "")}
    if run_python(deepspeed_python, ["-c", "import transformers"], env, timeout=300).returncode:
        pytest.skip(f"DeepSpeed's AutoTP needs transformers, which {deepspeed_python} cannot import")
    want = run_world(_train, saved, str(tmp_path / "ck"), stage, timeout=240)[0]["losses"][SAVE_AT:]
    tag = (tmp_path / "ck" / "latest").read_text().strip()
    universal = tmp_path / "universal"
    convert(tmp_path / "ck" / tag, universal / f"{tag}_universal")
    ours = run_world(_continue_universal, loaded, str(universal), stage, timeout=240)
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "deepspeed.json", tmp_path / "ext", loaded,
                            {"tp": 2, "stage": stage, "first": SAVE_AT, "steps": STEPS, "load": str(universal),
                             "checkpoint": {"load_universal": True}, "probe": False}, script=Path(job.__file__))
    print(f"ZeRO-{stage}, world {saved} -> {loaded}: dslaunch's continuation {want}; dslaunch from the universal folder within "
          f"{_worst(want, ours[0]['losses']):.2e}, DeepSpeed within {_worst(want, theirs[0]['losses']):.2e}")
    assert _worst(want, ours[0]["losses"]) <= 1e-6, (want, ours[0]["losses"])
    assert _worst(want, theirs[0]["losses"]) <= 1e-6, (want, theirs[0]["losses"])
    assert [r["global_steps"] for r in theirs] == [SAVE_AT] * loaded
    fresh = run_world(_continue_universal, loaded, None, stage, timeout=240)[0]["losses"]
    assert _worst(want, fresh) > 1e-3, (want, fresh)  # what was loaded makes the difference
