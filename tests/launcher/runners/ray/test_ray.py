"""``--launcher ray`` on a real local Ray cluster of 3 nodes (processes), and the engine inside Ray
Train's TorchTrainer: each against the same job under the local launcher.

Two Ray jobs share the module's cluster: one ``--launcher ray`` job (ZeRO-2, 4 workers on the 3
nodes, one node killed mid-run) and one TorchTrainer job (a worker fails once, FailureConfig
restarts it); the local launcher's losses are the reference for both."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import timeout_scale
from tests.launcher.helpers import ROOT, assert_no_job_process, new_tag, run_dslaunch, start_dslaunch

pytestmark = [pytest.mark.slow]

TRAIN = str(ROOT / "scripts" / "examples" / "ray_train.py")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(path: Path, world: int | None = None) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(path) if world is None or r["world"] == world}


def _local(tmp_path: Path, workers: int, *args: str) -> dict[int, float]:
    """The same job under the local launcher: the reference losses."""
    out = tmp_path / f"local{workers}.jsonl"
    run = run_dslaunch(["--num_gpus", str(workers), TRAIN, "--losses", str(out), *args], timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    return _losses(out)


@pytest.mark.timeout(500)
def test_a_zero2_job_on_three_ray_nodes_matches_the_local_launcher_and_a_killed_node_is_a_lost_host(
        ray_cluster, tmp_path):
    """4 workers on 3 nodes (2+1+1) have the local launcher's losses; then every process of one
    1-worker node is killed: the job goes on at world 3 from the last checkpoint (the surviving
    nodes' actors kept, the workers started in their warm spares), with the losses of a clean
    world-3 resume from it."""
    ckpt, out, tag = tmp_path / "ckpt", tmp_path / "elastic.jsonl", new_tag()
    args = [TRAIN, "--steps", "10", "--save_every", "2", "--ckpt", str(ckpt), "--sleep", "0.4"]
    proc = start_dslaunch(["--launcher", "ray", "--ray_address", ray_cluster.address, "--max_restarts", "1",
                           "--elastic_training", "--min_elastic_nodes", "2", "--resume_from", str(ckpt),
                           "--log_dir", str(tmp_path / "logs"), *args, "--losses", str(out)], tag=tag)
    victim = sorted(ray_cluster.worker_nodes(), key=lambda n: n.node_id)[-1]
    try:
        deadline = time.monotonic() + 200
        while max(_losses(out), default=0) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the checkpoint of step 2 is published once step 3 is logged
        assert max(_losses(out), default=0) >= 3, "the job did not reach step 3"
        killed_at = time.time()
        assert ray_cluster.kill_node(victim)
        stdout, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
        ray_cluster.replace_node(victim)
    assert proc.returncode == 0, stderr[-4000:]
    # The first run: 4 ranks on the 3 nodes, rank 0's node prints, the local launcher's losses.
    hosts = {line.split(": ")[0] for line in stdout.splitlines() if "] world=" in line or "] step " in line}
    assert len(hosts) == 1 and "world=4 resumed_at=0" in stdout, stdout
    assert len(set(re.findall(r"^(\S+): \[rank\d\]", stdout, re.M))) <= 3
    assert {int(r) for r in re.findall(r"\[rank(\d)\]", stdout + stderr)} <= {0, 1, 2, 3}
    before = {s: loss for s, loss in _losses(out, world=4).items() if s <= 3}
    assert before == pytest.approx(_local(tmp_path, 4, "--steps", "3"), abs=1e-6)
    # The kill: a lost host, the job restarted without it.
    assert re.search(r"without lost host\(s\) \S+-" + victim.node_id[:8], stderr), stderr[-3000:]
    assert "world size 3" in stderr, stderr[-3000:]
    resumed = [int(s) for s in re.findall(r"world=3 resumed_at=(\d+)", stdout)]
    assert len(resumed) == 1 and resumed[0] >= 2 and resumed[0] % 2 == 0, stdout
    after = [r for r in _records(out) if r["world"] == 3]
    assert after and after[0]["step"] == resumed[0] + 1
    print(f"node kill -> first step at world 3: {after[0]['t'] - killed_at:.1f} s")
    assert_no_job_process(tag, within=10)
    deadline = time.monotonic() + 10  # the actors, their standby agents and spares end with the job
    while (left := ray_cluster.agents()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [p.cmdline() for p in left]
    unpaced = args[1:args.index("--sleep")]  # the pace only gave the kill its moment
    clean = _local(tmp_path, 3, *unpaced, "--load", str(ckpt), "--load_tag", f"global_step{resumed[0]}")
    assert {r["step"]: r["loss"] for r in after} == pytest.approx(clean, abs=1e-6)


@pytest.mark.timeout(480)
def test_the_engine_inside_ray_trains_torchtrainer_matches_the_local_launcher_and_resumes_after_a_failure(
        ray_cluster, tmp_path):
    """Ray Train's process group (world 2) used by the engine; the last rank raises at step 3 once:
    FailureConfig restarts the group, which resumes from the checkpoint reported at step 2 through
    ``ray.train.get_checkpoint()``, not from step 0."""
    out = tmp_path / "trainer.jsonl"
    run = subprocess.run([sys.executable, TRAIN, "--ray_address", ray_cluster.address, "--num_workers", "2",
                          "--steps", "4", "--save_every", "2", "--fail_at", "3", "--max_failures", "1",
                          "--losses", str(out), "--storage", str(tmp_path / "storage")],
                         # the pytest timeout above grows with the load; this one must too (414 s
                         # measured at load 9-22 on 2 cores)
                         capture_output=True, text=True, timeout=420 * timeout_scale(os.getloadavg()[0], os.cpu_count() or 1),
                         cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    records = _records(out)
    steps = [r["step"] for r in records]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])  # the restarted group's first
    assert steps[:2] == [1, 2] and steps[restart:] == [3, 4], steps
    assert {r["world"] for r in records} == {2}
    local = _local(tmp_path, 2, "--steps", "4")
    assert all(r["loss"] == pytest.approx(local[r["step"]], abs=1e-6) for r in records), (records, local)
