"""In-memory peer checkpoints on the SSH test cluster: a host is lost (every process on it killed,
its memory gone) mid-run; the elastic restart resumes from the replica its peer host holds and
ends bitwise where a restore from a storage checkpoint of the same step ends.

Run under ``flock /tmp/dslaunch-cluster.lock`` (the cluster is shared)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import pytest
import torch

from tests.distributed import free_port
from tests.launcher.runners.ssh.helpers import ROOT, Lines
from tests.launcher.runners.ssh.test_elastic import _kill_host

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")


def _lose_second_host(cluster, tmp_path, name: str, *extra: str, memory: str | None = None):
    """2 hosts x 1 rank, elastic; the second host is killed after its step 7 (and, with ``memory``, its
    store removed: its RAM is gone). Returns the final weights, stdout and the job's events."""
    first, second = cluster.hosts[:2]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{first} slots=1\n{second} slots=1\n")
    ckpt, out, logs = tmp_path / f"ckpt_{name}", tmp_path / f"{name}.pt", tmp_path / f"logs_{name}"
    run = Lines(cluster.dslaunch(
        "--master_port", str(free_port()), "--max_restarts", "1", "--elastic_training", "--min_elastic_nodes", "1",
        "--resume_from", str(ckpt), "--log_dir", str(logs), SCRIPT, "--steps", "12", "--sleep", "0.3",
        "--ckpt", str(ckpt), "--out", str(out), *extra, hostfile=str(hostfile)))
    run.wait_for(r"rank1 step=7", 1, timeout=90)  # the snapshot (or checkpoint) of step 5 is complete
    with _kill_host(cluster, second):
        if memory is not None:
            (store,) = glob.glob(os.path.join(memory, "dslaunch-*", second))
            shutil.rmtree(store)
        assert run.finish(150) == 0, run.text("err")[-3000:]
    stdout = run.text("out")
    assert re.findall(r"rank0 world=1 resumed_at=(\d+)", stdout) == ["5"], stdout
    (job,) = glob.glob(str(logs / "*"))
    with open(os.path.join(job, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    return torch.load(out), stdout, events


@pytest.mark.timeout(400)
def test_a_lost_host_resumes_from_its_peers_replica_bitwise_as_from_storage(cluster, tmp_path):
    memory = str(tmp_path / "shm")
    got, stdout, events = _lose_second_host(cluster, tmp_path, "memory", "--save_every", "1000",
                                            "--memory_every", "5", "--memory_dir", memory, memory=memory)
    assert "dslaunch: resumed from peer memory at step 5 (snapshot memory_step5; newest storage checkpoint: none)" \
        in stdout, stdout
    (restored,) = [e for e in events if e["kind"] == "restored"]
    assert restored["source"] == "peer memory" and restored["step"] == 5 and restored["storage_step"] is None
    assert restored["steps_lost"] is not None and 0 <= restored["steps_lost"] <= 5, restored
    assert not glob.glob(os.path.join(memory, "dslaunch-*")), "the job's memory was not freed"
    want, _, _ = _lose_second_host(cluster, tmp_path, "storage", "--save_every", "5")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
