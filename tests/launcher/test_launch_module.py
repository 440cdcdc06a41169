"""``python -m dslaunch.launcher.launch`` (DeepSpeed's ``deepspeed.launcher.launch``): one node of a
job given by ``--world_info``, as DeepSpeed's runner and hand-written multi-node scripts call it.
Two such processes on this machine stand for two nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslaunch.launcher.runner import encode_world_info
from dslaunch.utils.ports import free_port

_SCRIPT = """
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "CUDA_VISIBLE_DEVICES")
seen = {k: os.environ.get(k) for k in keys}
seen["argv"] = sys.argv[1:]
dist.barrier()
with open(os.path.join(sys.argv[-1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(seen, f)
if "--fail" in sys.argv and dist.get_rank() == 2:
    sys.exit(7)
dist.barrier()
"""


def _launch(tmp_path: Path, world: dict, node_rank: int, port: int, *extra: str, flags: tuple = ()) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-u", "-m", "dslaunch.launcher.launch",
                             f"--world_info={encode_world_info(world)}", f"--node_rank={node_rank}",
                             "--master_addr=127.0.0.1", f"--master_port={port}", *flags, "train.py", *extra,
                             str(tmp_path)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(120)
def test_two_nodes_get_deepspeeds_ranks_and_variables(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_SCRIPT)
    world, port = {"node-a": [3], "node-b": [0, 1]}, free_port()
    procs = [_launch(tmp_path, world, rank, port, "--lr", "1") for rank in (0, 1)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    common = {"WORLD_SIZE": "3", "CROSS_SIZE": "2"}
    assert seen[0] == {**common, "RANK": "0", "LOCAL_RANK": "0", "CROSS_RANK": "0", "LOCAL_SIZE": "1",
                       "CUDA_VISIBLE_DEVICES": "3", "argv": ["--local_rank=0", "--lr", "1", str(tmp_path)]}
    # node-b's local ranks are 0 and 1 (DeepSpeed's launch computes rank % local size: 1 and 0)
    for r, local in ((1, 0), (2, 1)):
        assert seen[r] == {**common, "RANK": str(r), "LOCAL_RANK": str(local), "CROSS_RANK": "1", "LOCAL_SIZE": "2",
                           "CUDA_VISIBLE_DEVICES": "0,1", "argv": [f"--local_rank={local}", "--lr", "1", str(tmp_path)]}
    assert "--world_info: starting node 1 of 2 (node-b: ranks 1-2 of 3)" in outs[1][1]


@pytest.mark.timeout(120)
def test_a_failed_rank_ends_its_node_with_the_cause(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_SCRIPT)
    world, port = {"node-a": [0], "node-b": [0, 1]}, free_port()
    procs = [_launch(tmp_path, world, rank, port, "--fail", flags=("--no_local_rank",)) for rank in (0, 1)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert procs[1].returncode == 7, outs[1]
    assert "dslaunch: error: rank 2 on node-b exited with code 7; stopped all other workers" in outs[1][1], outs[1][1]
    assert json.loads((tmp_path / "rank0.json").read_text())["argv"] == ["--fail", str(tmp_path)]
    assert procs[0].returncode != 0  # its peer's node is gone: node 0's rank fails too, not hangs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, line", [
    ([], "--world_info is required: URL-safe base64 of the JSON {host: [slot, ...]}"),
    (["--world_info=%%%"], "--world_info '%%%': not URL-safe base64 of a JSON object"),
    ([f"--world_info={encode_world_info({'a': [0, 0]})}"], "--world_info: host 'a': expected a list of distinct slots"),
    ([f"--world_info={encode_world_info({'a': [0]})}", "--node_rank=1"], "--node_rank 1 is out of range (valid: 0"),
    ([f"--world_info={encode_world_info({'a': [0]})}", "--save_pid=42"], "--save_pid 42: DeepSpeed's runner's pid"),
])
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], line: str) -> None:
    (tmp_path / "train.py").touch()
    proc = subprocess.run([sys.executable, "-m", "dslaunch.launcher.launch", *args, "train.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2 and line in proc.stderr, proc.stderr
    assert len([x for x in proc.stderr.splitlines() if x.startswith("dslaunch: error:")]) == 1
    assert "Traceback" not in proc.stderr
