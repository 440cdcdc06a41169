#!/usr/bin/env python3
"""A Ray node lost mid-run: dslaunch ``--launcher ray`` (elastic) against Ray Train's own restart.

The job: ``scripts/examples/ray_train.py`` (ZeRO-2, a tiny MLP, a checkpoint every 2 steps, 0.4 s
per step), 4 workers on a local Ray cluster of 3 nodes (processes: 2, 1 and 1 CPUs;
``tests/launcher/runners/ray/cluster.py``). Once step 3 is logged (the checkpoint of step 2 is
published), every process of one 1-CPU node is SIGKILLed (raylet, actors, workers: the node is gone).

- ``dslaunch``: ``dslaunch --launcher ray --max_restarts 1 --elastic_training --min_elastic_nodes 2
  --resume_from CKPT``: the lost node is left out, the job restarts at world 3 from the checkpoint;
- ``ray_train``: the same loop in Ray Train's ``TorchTrainer`` with
  ``ScalingConfig(num_workers=(3, 4))`` (its elastic group) and ``FailureConfig(max_failures=1)``,
  checkpoints through ``ray.train.report``: Ray Train restarts its worker group from the last
  registered checkpoint. Ray Train registers a reported checkpoint only once its controller has
  polled every worker's report (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s): a node killed
  before then takes its report along and the restart begins from the checkpoint before (step 0
  in the first runs of this bench). So here the kill also waits for Ray Train's
  ``checkpoint_manager_snapshot.json`` to name a checkpoint.

Measured per trial, seconds from the kill, in the order a restart goes through them:
``detect`` (dslaunch's failure event; Ray Train logs none), ``stopped`` (the failed run's
``run_end``: every other node's workers stopped), ``restart`` (the policy's ``restart`` event,
then its backoff), ``agents`` (the ``resume`` event: the new run's node agents probed and have
their specs: placement group, actors, agents), then rank 0's own times (``--phases``): its
process ``started`` (before the kill: a warm spare), ``imported`` torch and the engine,
``initialized`` (rendezvous, engine, checkpoint loaded), and ``first_step`` (the first step
finished after the kill, from rank 0's step log); the new world size, the step resumed at, and
whether the job finished (exit 0). The load average is recorded: the machine is
shared, and every start-up (Ray workers, torch imports) stretches with it.

Writes ``results/ray_failover.{json,md}``. Run under ``flock /tmp/dslaunch-bench.lock``.

Usage: ``python scripts/bench/ray_failover_bench.py [--trials 1] [--systems dslaunch,ray_train]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.launcher.runners.ray.cluster import local_cluster  # noqa: E402

TRAIN = str(ROOT / "scripts" / "examples" / "ray_train.py")
JOB = ["--steps", "14", "--save_every", "2", "--sleep", "0.4"]
RESULTS = Path(__file__).resolve().parent / "results"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _registered(system: str, tmp: Path) -> bool:
    """Whether the job's newest checkpoint is one it would restart from (Ray Train: registered)."""
    if system != "ray_train":
        return True
    snapshot = tmp / "storage" / "ray_train" / "checkpoint_manager_snapshot.json"
    try:
        return json.loads(snapshot.read_text()).get("latest_checkpoint_result") is not None
    except (OSError, ValueError):
        return False


def _command(system: str, address: str, tmp: Path) -> list[str]:
    if system == "dslaunch":
        return [sys.executable, "-m", "dslaunch.launcher.cli", "--launcher", "ray", "--ray_address", address,
                "--max_restarts", "1", "--elastic_training", "--min_elastic_nodes", "2", "--resume_from",
                str(tmp / "ckpt"), "--log_dir", str(tmp / "logs"), TRAIN, *JOB, "--ckpt", str(tmp / "ckpt"),
                "--losses", str(tmp / "losses.jsonl")]
    return [sys.executable, TRAIN, "--ray_address", address, "--num_workers", "4", "--min_workers", "3",
            "--max_failures", "1", "--storage", str(tmp / "storage"), *JOB, "--losses", str(tmp / "losses.jsonl")]


PHASES = ("detect", "stopped", "restart", "agents", "started", "imported", "initialized", "first_step")


def _event_times(tmp: Path) -> dict[str, float]:
    """When dslaunch detected the failure, had stopped the run, decided the restart, and when the
    restarted run's agents had their specs (the first of each)."""
    times: dict[str, float] = {}
    names = {"run_end": "stopped", "restart": "restart", "resume": "agents"}
    for events in glob.glob(str(tmp / "logs" / "*" / "events.jsonl")):
        with open(events) as f:
            for event in map(json.loads, f):
                if event["kind"] == "failure":
                    times.setdefault("detect", event.get("detected_t"))
                elif event["kind"] in names:
                    times.setdefault(names[event["kind"]], event.get("t"))
    return times


def _phase_times(system: str, path: Path, killed: float) -> dict[str, float]:
    """Rank 0's process start, imports and initialization in the first run after the kill (not
    the imports under Ray Train: it ships the loop by value, with the driver's import time)."""
    after = [r for r in _records(path) if r["initialized"] > killed]
    phases = ("started", "initialized") if system == "ray_train" else ("started", "imported", "initialized")
    return {k: after[0][k] for k in phases} if after else {}


def trial(cluster, system: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="dsl-rayb-") as d:
        tmp = Path(d)
        losses, phases = tmp / "losses.jsonl", tmp / "phases.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([*_command(system, cluster.address, tmp), "--phases", str(phases)], cwd=tmp, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        victim = sorted(cluster.worker_nodes(), key=lambda n: n.node_id)[-1]
        try:
            deadline = time.monotonic() + 300
            while ((max((r["step"] for r in _records(losses)), default=0) < 3 or not _registered(system, tmp))
                   and time.monotonic() < deadline):
                if proc.poll() is not None:
                    raise RuntimeError(f"{system} ended before the fault: {proc.stdout.read()[-3000:]}")
                time.sleep(0.05)
            load = os.getloadavg()[0]
            killed = time.time()
            cluster.kill_node(victim)
            output, _ = proc.communicate(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
            cluster.replace_node(victim)
        after = [r for r in _records(losses) if r["t"] > killed]
        times = {**_event_times(tmp), **_phase_times(system, phases, killed), **({"first_step": after[0]["t"]} if after else {})}
        return {"system": system, "exit_code": proc.returncode, "load_avg_1m": round(load, 1),
                **{f"{k}_s": round(times[k] - killed, 2) if times.get(k) else None for k in PHASES},
                "world_after": after[0]["world"] if after else None,
                "resumed_at": after[0]["step"] - 1 if after else None,
                "tail": "" if proc.returncode == 0 else output[-2000:]}


def _table(rows: list[dict]) -> str:
    lines = ["| system | exit | load (1 min) | " + " | ".join(PHASES) + " | world after | resumed at step |",
             "|---" * (len(PHASES) + 5) + "|"]
    for r in rows:
        cells = " | ".join("-" if r.get(f"{k}_s") is None else f"{r[f'{k}_s']:g}" for k in PHASES)
        lines.append(f"| {r['system']} | {r['exit_code']} | {r['load_avg_1m']} | {cells} | {r['world_after']} "
                     f"| {r['resumed_at']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--systems", default="dslaunch,ray_train")
    args = p.parse_args()
    rows = []
    with local_cluster() as cluster:
        for _ in range(args.trials):
            for system in args.systems.split(","):
                rows.append(trial(cluster, system))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "tail"}), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ray_failover.json").write_text(json.dumps(rows, indent=1) + "\n")
    (RESULTS / "ray_failover.md").write_text(_table(rows) + "\n")
    print(_table(rows))


if __name__ == "__main__":
    main()
