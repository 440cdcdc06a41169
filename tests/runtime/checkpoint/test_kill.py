"""A 2-rank training job SIGKILLed while it saves: the newest published tag always verifies."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest

from dslaunch.runtime.checkpoint.store import CheckpointStore, first_loadable
from tests.distributed import _CTX, free_port
from tests.runtime.checkpoint.helpers import verify


def _worker(root: str, saves: int, stall: bool = False) -> None:
    """One rank: train and save every step (``saves`` times, 0: forever); report each save.

    ``stall``: the leader's save stops for good just before it publishes (its ``.tmp-``/``.owner-``
    files are written), so a kill then surely lands mid-save.
    """
    import torch

    import dslaunch

    if stall:
        from dslaunch.runtime.checkpoint.publish import LeaderSave

        LeaderSave.install = lambda *args, **kwargs: time.sleep(3600)  # type: ignore[method-assign]

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # ~6 MB state
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "checkpoint": {"keep_last": 2}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    x = torch.randn(2, 512)
    done = Path(root) / f"confirmed{engine.global_rank}"
    while saves == 0 or engine.global_steps < saves:
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(root)
        done.write_text(str(engine.global_steps))  # after save_checkpoint returned: durable
    torch.distributed.destroy_process_group()


def _rank(rank: int, port: int, root: str, saves: int, stall: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.stderr = open(os.devnull, "w")  # the survivor's gloo errors are expected noise
    _worker(root, saves, stall)


def _start(root: Path, port: int, saves: int = 0, stall: bool = False) -> list:
    # forkserver with torch preloaded (tests.distributed): no torch import per rank
    procs = [_CTX.Process(target=_rank, args=(rank, port, str(root), saves, stall), daemon=True)
             for rank in range(2)]
    for p in procs:
        p.start()
    return procs


def _confirmed(root: Path) -> int:
    values = []
    for rank in range(2):
        try:
            values.append(int((root / f"confirmed{rank}").read_text() or 0))
        except (FileNotFoundError, ValueError):
            values.append(0)
    return max(values)


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-", ".owner-",
                                                                          ".latest.tmp", ".trash-")))


def _kill_mid_save(root: Path, victims: tuple[int, ...], rng: random.Random) -> None:
    """Start the job, let it save at least once, SIGKILL ``victims``, check what is loadable."""
    store = CheckpointStore(root)
    for rank in range(2):
        (root / f"confirmed{rank}").unlink(missing_ok=True)
    procs = _start(root, free_port())
    deadline = time.monotonic() + 60
    while _confirmed(root) < 1 and time.monotonic() < deadline:
        assert all(p.is_alive() for p in procs), "a rank exited early"
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.3))  # a save takes most of each step: mostly mid-save
    for rank in victims:
        procs[rank].kill()
    for p in procs:
        p.join(timeout=20)  # a survivor fails on the lost peer
        if p.is_alive():
            p.kill()
            p.join()
    last = _confirmed(root)
    tags, _ = store.candidates()
    tag, manifest, _ = first_loadable(tags, lambda t: verify(store, t))
    assert manifest.meta["global_steps"] >= last >= 1, (tag, last)
    for m in store.tags():  # every published tag is complete
        verify(store, m.tag)


@pytest.mark.timeout(240)
def test_killed_job_leaves_a_verified_latest(tmp_path: Path) -> None:
    rng = random.Random(7)
    victims_by_round = [(0, 1), (0,), (1,)]  # both ranks, only the leader, only the follower
    # One random kill per victim set (each restart saves global_step1, 2, ... again, overwriting
    # tags); the stalled run below is the kill that surely lands mid-save, so a second round of
    # random ones added time, not cases.
    for victims in victims_by_round:
        _kill_mid_save(tmp_path, victims, rng)
    # A kill that surely lands mid-save (random ones may all fall between saves on a busy machine).
    stalled = _start(tmp_path, free_port(), stall=True)
    deadline = time.monotonic() + 120
    while not any(n.startswith(".tmp-") for n in _leftovers(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in stalled:
        p.kill()
        p.join()
    assert any(n.startswith(".owner-") for n in _leftovers(tmp_path)), _leftovers(tmp_path)
    # The next save removes what the killed saves left (their owner is dead).
    procs = _start(tmp_path, free_port(), saves=1)
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert _leftovers(tmp_path) == []
    store = CheckpointStore(tmp_path)
    assert store.read_latest()[0] == "global_step1" and verify(store, "global_step1")
