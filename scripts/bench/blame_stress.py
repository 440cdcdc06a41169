"""Blame stress: pipeline jobs in which stage k raises, under CPU hogs; count the runs whose
report names another rank.

Each run launches ``tests/launcher/bin/raise_train.py`` through ``dslaunch`` (gloo, one process per
stage): stage k raises inside its forward mid-training, the other stages then fail on the stop it
sends them (or on its departure). The runs cycle through k = first, middle, last at 2 and 4
stages. A run is right when all three reports a user reads name rank k: the job's last line
(``rank k on localhost raised ValueError``), the error files (exactly ``error-rank<k>.json``, the
root cause) and ``dslaunch status``'s root cause; and the exit code is 1.

Busy loops (``python -c "while True: pass"``, ``--hogs``, default 2) load the cores for the whole
run: which process exits first is then a matter of scheduling. Writes ``blame_stress.json`` and
``blame_stress.md`` into ``--out`` (default scripts/bench/results); exits 1 when any run was wrong.

Usage: ``python scripts/bench/blame_stress.py [--runs 20] [--hogs 2] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "launcher" / "bin" / "raise_train.py"
DSLAUNCH = [sys.executable, "-m", "dslaunch.launcher.cli"]
CASES = [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]  # (stages, the stage that raises)


def _free_port() -> int:
    sys.path.insert(0, str(ROOT))
    from dslaunch.utils.ports import free_port

    return free_port()


def one_run(stages: int, fail: int, root: Path) -> dict:
    """Launch one job; what each report named."""
    logs = root / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STAGES": str(stages), "FAIL_RANK": str(fail)}
    start = time.monotonic()
    r = subprocess.run([*DSLAUNCH, "--num_gpus", str(stages), "--master_port", str(_free_port()), "--log_dir",
                        str(logs), str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    last = (r.stderr.strip().splitlines() or [""])[-1]
    jobs = glob.glob(str(logs / "*"))
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(jobs[0], "error-rank*.json"))) if jobs else []
    status = subprocess.run([*DSLAUNCH, "status", jobs[0]], capture_output=True, text=True, timeout=60).stdout if jobs else ""
    cause = next((line for line in status.splitlines() if line.startswith("root cause: ")), "")
    named = {"message": _rank(last), "error_files": files, "status": _rank(cause)}
    right = (r.returncode == 1 and named["message"] == fail and files == [f"error-rank{fail}.json"]
             and named["status"] == fail and f"raised ValueError: rank {fail} broke" in last)
    return {"stages": stages, "fail": fail, "exit_code": r.returncode, "right": right, **named,
            "seconds": round(time.monotonic() - start, 1), "last_line": last[-300:]}


def _rank(line: str) -> int | None:
    m = re.search(r"rank (\d+) on ", line)
    return int(m[1]) if m else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "scripts" / "bench" / "results"))
    args = parser.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    records = []
    load = [os.getloadavg()[0]]
    try:
        for i in range(args.runs):
            stages, fail = CASES[i % len(CASES)]
            with tempfile.TemporaryDirectory(prefix="blame-stress-") as tmp:
                records.append(one_run(stages, fail, Path(tmp)))
            print(json.dumps(records[-1]), flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    load.append(os.getloadavg()[0])
    wrong = [r for r in records if not r["right"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "blame_stress.json").write_text(json.dumps({"hogs": args.hogs, "load_1min": load, "runs": records},
                                                      indent=2) + "\n")
    lines = [f"## Blame stress: {len(records)} pipeline jobs, stage k raises, {args.hogs} CPU hogs "
             "(`scripts/bench/blame_stress.py`)", "",
             f"{len(records) - len(wrong)} of {len(records)} named stage k in the message, the error file and "
             f"`dslaunch status`; load average (1 min) {load[0]:.1f} at the start, {load[-1]:.1f} at the end.", "",
             "| stages | k | runs | right | median s |", "|---|---|---|---|---|"]
    for stages, fail in CASES:
        mine = [r for r in records if (r["stages"], r["fail"]) == (stages, fail)]
        if mine:
            secs = sorted(r["seconds"] for r in mine)
            lines.append(f"| {stages} | {fail} | {len(mine)} | {sum(r['right'] for r in mine)} | "
                         f"{secs[len(secs) // 2]:.1f} |")
    (out / "blame_stress.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
