"""In-memory checkpoints (``runtime/checkpoint/memory.py``): a restarted run resumes from the newest
complete snapshot in host memory, bitwise where a storage restore at that step (and an
uninterrupted run) ends; the choice of
snapshot never takes an incomplete one; replicas go to the same local rank of the next host."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch

from dslaunch.runtime.checkpoint.memory import _inventory, choose, peers
from dslaunch.runtime.checkpoint.store import CheckpointStore
from dslaunch.runtime.checkpoint.writer import LocalComm, TagWrite, write_tag
from dslaunch.utils.ports import free_port
from tests.launcher.helpers import ROOT, run_dslaunch

SCRIPT = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")


def test_each_rank_replicates_to_the_same_local_rank_of_the_next_host():
    assert peers(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert peers(["a", "b", "c"]) == [1, 2, 0]
    assert peers(["a", "a", "b"]) == [2, 2, 0]  # the next host has one rank: it takes both
    assert peers(["a", "a"]) == [None, None]  # one host: no replica


def test_the_newest_snapshot_the_live_hosts_hold_between_them_is_chosen():
    files = ["module.dsl", "zero_rank_00000.dsl", "zero_rank_00001.dsl"]
    a6 = ("memory_step6", (6, ["manifest.json", "module.dsl", "zero_rank_00000.dsl"], files))
    b6 = ("memory_step6", (6, ["manifest.json", "module.dsl", "zero_rank_00001.dsl"], files))
    b9 = ("memory_step9", (9, ["manifest.json", "module.dsl", "zero_rank_00001.dsl"], files))
    # step 9 lacks rank 0's shard on every host: step 6, which the two hosts hold together
    assert choose([("a", dict([a6])), ("b", dict([b6, b9]))]) == ("memory_step6", 6)
    assert choose([("b", dict([b6, b9]))]) is None  # host a is gone and had no replica on b
    assert choose([]) is None


def test_a_snapshot_being_written_or_with_a_short_file_is_not_offered(tmp_path):
    store = CheckpointStore(tmp_path, durable=False)
    files = {"zero_rank_00000.dsl": {"w": torch.ones(4)}, "rank_00000.dsl": {"step": 6}}
    write_tag(LocalComm(), TagWrite(store, "memory_step6", files, {"global_steps": 6}, leader=True))
    (tmp_path / ".tmp-memory_step9").mkdir()  # a host died while writing it: never published
    (tmp_path / ".tmp-memory_step9" / "zero_rank_00000.dsl").write_bytes(b"x" * 10)
    step, held, every = _inventory(store)["memory_step6"]
    assert list(_inventory(store)) == ["memory_step6"] and step == 6
    assert set(held) == {"manifest.json", *files} and set(every) == set(files)
    shard = tmp_path / "memory_step6" / "zero_rank_00000.dsl"
    shard.write_bytes(shard.read_bytes()[:-1])  # cut short (a copy that never finished)
    assert "zero_rank_00000.dsl" not in _inventory(store)["memory_step6"][1]


def _train(tmp_path, name: str, *extra: str, resume: str, fault: bool = True):
    out = tmp_path / f"{name}.pt"
    faulted = ("--fault_rank", "1", "--fault_step", "7") if fault else ()
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port()), "--max_restarts", "1",
                      "--resume_from", str(tmp_path / resume), "--log_dir", str(tmp_path / f"logs_{name}"),
                      SCRIPT, "--steps", "10", "--ckpt", str(tmp_path / resume), "--out", str(out),
                      *faulted, *extra], timeout=200)
    assert r.returncode == 0, r.stderr
    assert len(re.findall(r"resumed_at=6$", r.stdout, re.M)) == (2 if fault else 0), r.stdout
    return r, torch.load(out)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_killed_rank_resumes_from_memory_bitwise_as_from_storage_at_that_step(tmp_path):
    # storage every 4 steps, memory every 3: rank 1 is killed at step 7, after the snapshot of step
    # 6 and the storage checkpoint of step 4; the restart must take step 6 from memory
    mem = tmp_path / "shm"
    r, got = _train(tmp_path, "memory", "--save_every", "4", "--memory_every", "3", "--memory_dir", str(mem),
                    resume="ckpt_memory")
    assert "dslaunch: resumed from memory at step 6 (snapshot memory_step6; newest storage checkpoint: step 4)" \
        in r.stdout, r.stdout
    # the reference: the same job uninterrupted, which a restore of that step from a storage
    # checkpoint ends bitwise equal to (tests/launcher/monitor/test_resume.py, same script), so
    # it stands for that restore without a kill and a restart of its own
    _, want = _train(tmp_path, "uninterrupted", "--save_every", "6", resume="ckpt_storage", fault=False)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    (job,) = glob.glob(str(tmp_path / "logs_memory" / "*"))
    with open(os.path.join(job, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    (restored,) = [e for e in events if e["kind"] == "restored"]
    assert restored["source"] == "memory" and restored["step"] == 6 and restored["storage_step"] == 4
    # counted from the furthest step the monitor heard: heartbeats are sampled, so on a fast run it
    # may trail the kill at step 7 (or be unknown); never negative, never more than the ranks ran
    assert restored["steps_lost"] in (None, 0, 1, 2), restored
    held = [e["memory_checkpoint"] for e in events if e["kind"] == "summary" and "memory_checkpoint" in e]
    # each attempt's summary says what the monitor last heard of each host's store (sampled, as
    # steps_lost above): the killed attempt's may predate its first snapshot's report; the job's
    # last one holds the snapshot, and no summary names a step without its bytes
    assert held and all(v["bytes"] > 0 for v in held[-1].values()), held
    assert all(v["step"] is None or v["bytes"] > 0 for h in held for v in h.values()), held
    # the job's memory is freed when it ends
    assert not list(mem.glob("dslaunch-*")), list(mem.glob("*/*"))


def test_the_monitor_reports_the_restore_with_the_steps_lost_and_each_host_s_store(tmp_path):
    from dslaunch.launcher.monitor.events import EventLog
    from dslaunch.launcher.monitor.job import JobMonitor
    from dslaunch.launcher.monitor.memory_store import free_memory_stores
    from dslaunch.launcher.monitor.status import format_progress
    from dslaunch.launcher.spec import JobSpec, MonitorSpec
    from dslaunch.utils.beat import Beat
    from tests.launcher.monitor.test_job import BeatingNode

    events = EventLog(None)
    events.emit("summary", step=14)  # the furthest the job got before the restart
    events.emit("resume", restart=1)
    store = tmp_path / f"dslaunch-{os.getuid()}-job1"
    (store / "node0").mkdir(parents=True)
    beat = Beat(0, 1, None, memory_checkpoint={"host": "node0", "step": 10, "bytes": 3 << 30, "store": str(store),
                                               "restored": {"source": "peer memory", "step": 10,
                                                            "storage_step": 5}})
    node = BeatingNode({0: beat}, {})
    monitor = JobMonitor(JobSpec((node.node,), "127.0.0.1", 29500, 1, monitor=MonitorSpec(5.0)), events,
                         owns_log=False)
    monitor.observe([node])
    monitor.observe([node])  # said once
    (restored,) = [e for e in events.events if e["kind"] == "restored"]
    assert (restored["source"], restored["step"], restored["storage_step"], restored["steps_lost"]) == \
        ("peer memory", 10, 5, 4)
    summary = monitor._summary()
    assert summary["memory_checkpoint"] == {"node0": {"step": 10, "bytes": 3 << 30}}
    assert format_progress({**summary, "ranks_up": 1, "world": 1, "step": 11}).endswith(
        "memory checkpoint step 10 (3.0 GiB on 1 host(s))")
    other = tmp_path / "someone-else"
    other.mkdir()
    events.emit("memory_store", host="x", path=str(other))  # not the job's: left alone
    assert free_memory_stores(events.events, "job1") == [str(store)]
    assert not store.exists() and other.exists()


def _lost_store_comes_back(rank: int, world: int, root: str) -> tuple[str, bool, list[str], bool, bool]:
    """Two "hosts" of one rank each (hostnames patched): snapshots at steps 2, 4, 6 and 8, the
    second host's store is lost, the weights are spoiled, and the resume fetches its files from the
    first host's replica. Returns the source, whether the weights are the snapshot's, the
    checkpoint collectives the training thread ran during the second snapshot, whether the replica
    of the peer's shard equals the peer's own copy byte for byte, and whether the snapshots of
    steps 6 and 8 took over the files (the pages) of those of steps 2 and 4, own shard and replica
    alike, leaving two snapshots in the store."""
    import shutil
    import socket
    import threading

    import dslaunch
    from dslaunch.runtime.checkpoint.checkpointer import zero_file
    from dslaunch.runtime.checkpoint.memory import MemoryCheckpoint
    from dslaunch.runtime.config.memory_checkpoint import MemoryCheckpointConfig

    socket.gethostname = lambda: f"host{rank}"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    memory = MemoryCheckpoint(MemoryCheckpointConfig(enabled=True, interval=2, dir=root), engine.checkpoint_parts(),
                              "job")
    comm = engine.checkpoint_parts().io.comm
    gather, on_main = comm.all_gather_object, []

    def watched(obj):
        if threading.current_thread() is threading.main_thread():
            on_main.append(type(obj).__name__)
        return gather(obj)

    comm.all_gather_object = watched
    store, inodes = memory.store.root, {}
    for snapshot in range(4):
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 8)).square().mean())
            engine.step()
        on_main.clear()  # the first snapshot gathers the partition map; later ones run none here
        memory.snapshot(engine.checkpoint_parts())
        engine.wait_for_checkpoint()
        if snapshot == 1:
            during = list(on_main)
        inodes[2 * snapshot + 2] = {r: os.stat(store / f"memory_step{2 * snapshot + 2}" / zero_file(r)).st_ino
                                    for r in range(2)}
    reused = inodes[6] == inodes[2] and inodes[8] == inodes[4] and \
        sorted(p.name for p in store.iterdir() if p.is_dir()) == ["memory_step6", "memory_step8"]
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    torch.distributed.barrier()
    peer = 1 - rank  # its replica here is byte for byte the file it wrote on its own host
    here, there = (memory.store.root.parent / f"host{h}" / "memory_step8" / zero_file(peer) for h in (rank, peer))
    replica_equal = here.read_bytes() == there.read_bytes()
    torch.distributed.barrier()
    if rank == 1:
        shutil.rmtree(memory.store.root)  # its RAM is gone; the host is back
    torch.distributed.barrier()
    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()
    resumed = memory.resume(engine.checkpoint_parts(), None, lambda d, t: engine.load_checkpoint(d, tag=t))
    same = all(torch.equal(saved[k], v) for k, v in engine.module.state_dict().items())
    return resumed.source, same and engine.global_steps == 8, during, replica_equal, reused


@pytest.mark.timeout(120)
def test_a_host_whose_store_was_lost_fetches_its_files_from_the_peer_replica(tmp_path):
    from tests.distributed import run_world

    assert run_world(_lost_store_comes_back, 2, str(tmp_path)) == [("peer memory", True, [], True, True)] * 2


def test_a_replica_that_cannot_be_stored_is_still_received(tmp_path):
    from dslaunch.runtime.checkpoint.memory import _receive_into

    buf, err = _receive_into(tmp_path, "zero_rank_00001.dsl", 1 << 20)
    assert err is None and buf.numel() == 1 << 20
    buf[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)  # received straight into the file's pages
    assert (tmp_path / "zero_rank_00001.dsl").read_bytes()[:4] == bytes([1, 2, 3, 0])
    buf, err = _receive_into(tmp_path, "zero_rank_00001.dsl", 16)  # exists: no file, but a buffer
    assert buf.numel() == 16 and "zero_rank_00001.dsl" in err
