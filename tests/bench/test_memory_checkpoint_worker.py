"""``scripts/bench/memory_checkpoint_worker.py``'s interleaved mode (the GPT rows of
``memory_checkpoint_bench.py``), on a one-layer GPT: blocks alternate snapshots on and off, every
"on" block really takes a snapshot, and each block reports its wall and CPU time."""

import re

import pytest

from dslaunch.utils.ports import free_port
from tests.launcher.helpers import ROOT, run_dslaunch

WORKER = str(ROOT / "scripts" / "bench" / "memory_checkpoint_worker.py")


@pytest.mark.timeout(150)
def test_blocks_alternate_snapshots_on_and_off_and_report_their_cost(tmp_path):
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port()), "--log_dir", str(tmp_path / "logs"),
                      WORKER, "--model", "gpt", "--gpt_layers", "1", "--gpt_width", "48", "--seq", "16",
                      "--pairs", "2", "--memory_every", "2", "--memory_dir", str(tmp_path / "shm")], timeout=140)
    assert r.returncode == 0, r.stderr[-3000:]
    blocks = re.findall(r"block=(\d) on=([01]) wall=([\d.]+) cpu=([\d.]+) published=([01])$", r.stdout, re.M)
    # on-off, then off-on; an "on" block's snapshot is complete (published) when it ends
    assert [(int(i), int(on), int(done)) for i, on, _, _, done in blocks] == \
        [(0, 1, 1), (1, 0, 0), (2, 0, 0), (3, 1, 1)], r.stdout
    assert all(float(wall) > 0 and float(cpu) > 0 for _, _, wall, cpu, _ in blocks)
