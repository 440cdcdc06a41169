"""Same-host shared-memory collectives (``runtime/zero/shm.py``, ``shared_memory_collectives``).

- the collectives against gloo's: bit for bit at world 2, the sum in group-rank order at world 4,
  through slots smaller than the tensors (several pieces) and in place in shared buffers;
- training through them equals training over gloo bit for bit (ZeRO-1/2/3, world 2): the same
  sums, so the same weights; the stages' equality at world 4 is ``test_equivalence_matrix``'s;
- stage 3's gathers read the owners' shards in place: a forward's parameter inside one owner's
  shard is a view of it (no copy), ``GatheredParameters`` gets copies, and the modifier rank's
  write (only its) reaches the shards;
- the switch: ``"never"`` and ``DSLAUNCH_SHM_COLLECTIVES=0`` keep gloo, ``=1`` overrides ``"never"``,
  ``"auto"`` is the default (on);
- a rank killed with SIGKILL mid-step leaves nothing of the job in ``/dev/shm``; a segment left by
  a creator killed during setup is removed by the next one made, once its creator is gone.
"""

from __future__ import annotations

import glob
import os

import pytest

from tests.distributed import run_world

WIDTH = 24


def _config_decides() -> None:
    """These tests are about the transport: the config picks it, whatever the suite's environment."""
    os.environ.pop("DSLAUNCH_SHM_COLLECTIVES", None)


def _collectives(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from dslaunch.runtime.zero.partition import partition_range as split
    from dslaunch.runtime.zero.shm import SharedMemoryCollectives, SharedTensors

    dist.init_process_group("gloo")
    shm = SharedMemoryCollectives(None, slot_bytes=4 * 40)  # 40 floats a slot: every call in pieces
    n = 101
    every = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    mine = every[rank]
    in_order = every[0] + every[1]
    for t in every[2:]:
        in_order = in_order + t
    gloo = mine.clone()
    dist.all_reduce(gloo)
    out = {"order": in_order}
    x = mine.clone()
    shm.all_reduce(x)
    out["all_reduce"] = x
    lo, hi = split(n, world, rank)
    x = mine.clone()
    shm.reduce_scatter(x, lo, hi)
    out["reduce_scatter"] = (x[lo:hi], x[:lo], x[hi:])
    lengths = [7 + 30 * r for r in range(world)]  # unequal, some longer than a slot
    gathered = [torch.full((k,), -1.0) for k in lengths]
    gathered[rank] = torch.arange(lengths[rank], dtype=torch.float32) + 1000 * rank
    shm.all_gather(gathered)
    out["all_gather"] = gathered
    shared = SharedTensors(shm, n, torch.float32)
    shared.mine.copy_(mine)
    shared.reduce(10, 50, 0, 0, scatter=False, name="t")  # elements [10, 60) on every rank
    out["in_place"] = shared.mine.clone()
    shared.mine.copy_(mine)
    a, b = split(50, world, rank)
    shared.reduce(10, 50, a, b, scatter=True, name="t")
    out["in_place_scatter"] = (shared.mine[10 + a:10 + b].clone(), (a, b))
    out["gloo"], out["mine"], out["lo_hi"] = gloo, mine, (lo, hi)
    out["left"] = glob.glob(f"/dev/shm/dslaunch-shm-zero*-{os.getpid()}-*")
    return _plain(out)


def _plain(x):
    """Tensors as lists (a tensor sent back through the result queue needs its sender alive)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_sum_in_rank_order_and_match_gloo_at_two_ranks(world: int) -> None:
    for r in run_world(_collectives, world):  # float32 values as Python floats: equal means same bits
        order, mine = r["order"], r["mine"]
        assert r["all_reduce"] == order
        if world == 2:  # a + b == b + a: gloo's bits
            assert r["gloo"] == order
        lo, hi = r["lo_hi"]
        own, before, after = r["reduce_scatter"]
        assert own == order[lo:hi]
        assert before == mine[:lo] and after == mine[hi:]  # the rest untouched
        for q, got in enumerate(r["all_gather"]):
            assert got == [float(i + 1000 * q) for i in range(len(got))]
        assert r["in_place"][10:60] == order[10:60]
        assert r["in_place"][:10] == mine[:10] and r["in_place"][60:] == mine[60:]
        got, (a, b) = r["in_place_scatter"]
        assert got == order[10 + a:10 + b]
        assert r["left"] == []  # unlinked once mapped


def _train(rank: int, world: int, stage: int) -> dict:
    _config_decides()
    import torch

    import dslaunch
    from dslaunch.runtime.zero.exchange import SharedMemoryExchange

    out = {}
    for setting in ("on", "never"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 3))
        cfg = {"train_batch_size": 4 * world, "shared_memory_collectives": setting, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 300,
                                     "allgather_bucket_size": 300, "stage3_param_persistence_threshold": 30}}
        engine, *_ = dslaunch.initialize(model=model, config=cfg)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            engine.backward(engine(torch.randn(4, WIDTH, generator=g)).square().mean())
            engine.step()
        engine.zero.synchronize()
        with dslaunch.zero.GatheredParameters(list(model.parameters())):
            out[setting] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
        out[f"{setting}_shm"] = isinstance(engine.zero.exchange, SharedMemoryExchange)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_through_shared_memory_equals_gloo(stage: int) -> None:
    for r in run_world(_train, 2, stage, timeout=140):
        assert r["on_shm"] and not r["never_shm"]
        assert r["on"] == r["never"]  # bit for bit


def _shared_shards(rank: int, world: int) -> dict:
    import torch

    import dslaunch
    from dslaunch.runtime.zero import params as zp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 3))
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_batch_size": 2 * world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "shared_memory_collectives": "on", "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    in_place = []
    for m in model:
        m.register_forward_hook(lambda m, i, o: in_place.append(m.weight._dsl_flat.gatherer.shares(m.weight)))
    engine.backward(engine(torch.randn(2, WIDTH)).square().mean())
    engine.step()
    w = model[1].weight
    with dslaunch.zero.GatheredParameters([w], modifier_rank=0):
        copied = not w._dsl_flat.gatherer.shares(w)
        w.data.fill_(1.0 if rank == 0 else 2.0)  # rank 1's write is discarded
    with dslaunch.zero.GatheredParameters([w]):
        after = sorted(set(w.reshape(-1).tolist()))
    return {"in_place": in_place, "shared": isinstance(w._dsl_flat.gatherer, zp.SharedShards), "copied": copied,
            "after": after}


def test_stage3_gathers_read_the_shards_in_place_and_gathered_parameters_write_them() -> None:
    for r in run_world(_shared_shards, 2):
        assert r["shared"] and r["copied"]
        # 675 elements, 338 a rank: the first weight [0, 576) spans both shards (copied), the
        # second [600, 672) lies in rank 1's (a view of it)
        assert r["in_place"] == [False, True]
        assert r["after"] == [1.0]



def _write_after_a_slow_read(rank: int, world: int) -> dict:
    import time

    import torch

    import dslaunch

    torch.manual_seed(0)
    # 600 elements, 300 a rank: the first weight [0, 96) lies in rank 0's shard (a view of it)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4), torch.nn.Linear(4, 100))
    zeros = {f"module.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_batch_size": 2 * world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "shared_memory_collectives": "on", "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(0))
    engine.eval()
    with torch.no_grad():
        before = engine(x).tolist()
    if rank == 1:  # after the gather (the engine's hook runs first), before the read
        model[0].register_forward_pre_hook(lambda m, a: time.sleep(1.0))
    with torch.no_grad():
        out = engine(x).tolist()
    # rank 0 gets here first: its shard must not change under rank 1's read
    engine.load_state_dict(zeros)
    return {"same": out == before}


def test_a_shard_is_not_written_while_a_peer_still_reads_it() -> None:
    # each forward ends with a wait of the group: rank 0's write waits for rank 1's slow read
    for r in run_world(_write_after_a_slow_read, 2):
        assert r["same"]


def _switch(rank: int, world: int) -> list:
    import torch

    import dslaunch

    out = []
    for env, setting in (("0", "on"), ("1", "never"), ("", "auto")):
        os.environ["DSLAUNCH_SHM_COLLECTIVES"] = env
        engine, *_ = dslaunch.initialize(model=torch.nn.Linear(4, 4), config={
            "train_batch_size": 2 * world, "shared_memory_collectives": setting,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}})
        out.append([engine.zero.exchange.name, engine.zero.publisher.shm is None])
    return out


def test_the_environment_switch_overrides_the_config_and_auto_is_on() -> None:
    for r in run_world(_switch, 2):
        assert r == [["flat", True], ["shared_memory", False], ["shared_memory", False]]


def _killed(rank: int, world: int, pids: str) -> None:
    _config_decides()
    import signal

    import torch

    import dslaunch

    with open(os.path.join(pids, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_batch_size": 2 * world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "shared_memory_collectives": "on", "zero_optimization": {"stage": 2, "reduce_bucket_size": WIDTH * WIDTH}})
    if rank == 1:  # dies in backward, between two buckets' reductions
        model[1].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
    for _ in range(2):
        engine.backward(engine(torch.randn(2, WIDTH)).square().mean())
        engine.step()


@pytest.mark.timeout(90)
def test_a_rank_killed_mid_step_leaves_nothing_in_dev_shm(tmp_path) -> None:
    with pytest.raises(AssertionError, match="rank"):
        run_world(_killed, 2, str(tmp_path), timeout=60)
    pids = [(tmp_path / str(r)).read_text() for r in range(2)]
    assert pids[0] and pids[1]
    left = [f for pid in pids for f in glob.glob(f"/dev/shm/dslaunch-*-{pid}-*")]
    assert left == []


def _full_gradient(rank: int, world: int) -> dict:
    _config_decides()
    import torch

    import dslaunch

    out = {}
    for setting in ("on", "never"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 3))
        engine, *_ = dslaunch.initialize(model=model, config={
            "train_batch_size": 2 * world, "shared_memory_collectives": setting,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}})
        engine.backward(engine(torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))).square().mean())
        out[setting] = [p.grad.reshape(-1).tolist() for p in model.parameters()]
    return out


def test_stage_1_keeps_the_whole_reduced_gradient() -> None:
    # after backward every rank reads every element of the reduced gradient, as over gloo
    # (the pipeline's tied-weight sum reads ranges another rank updates)
    results = run_world(_full_gradient, 2)
    for r in results:
        assert r["on"] == r["never"]  # bit for bit at world 2
    assert results[0]["on"] == results[1]["on"]


def test_a_segment_whose_creator_is_gone_is_removed_by_the_next(tmp_path) -> None:
    import subprocess
    import sys
    import time

    from dslaunch.runtime.inference.shm_allreduce import ORPHAN_AGE_S, remove_orphans

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    old = time.time() - 2 * ORPHAN_AGE_S
    files = {"orphan": f"dslaunch-shm-zero-buf-{dead}-0123456789ab", "young": f"dslaunch-shm-zero-{dead}-0123456789ac",
             "live": f"dslaunch-shm-zero-{os.getpid()}-0123456789ad", "other": f"dslaunch-{os.getuid()}-job-{dead}-x"}
    for key, name in files.items():
        (tmp_path / name).write_bytes(b"x")
        if key != "young":
            os.utime(tmp_path / name, (old, old))
    assert remove_orphans(str(tmp_path)) == [str(tmp_path / files["orphan"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in files.items() if k != "orphan")
