"""Stage 3's memory, measured on the tensors the engine actually holds (``held.py``), and under a
real per-rank memory limit (cgroup v1).

At rest (after a step) each rank holds 1/N of stage 0's parameter + optimizer-state bytes: the
gradient shard and the reduce buckets are freed at ``zero_grad``, as FSDP2 frees them; while forward and backward run, the whole parameters on top of that
(sampled in module and gradient hooks) stay within ``stage3_max_live_parameters``. With CPU offload
the optimizer state is the host copies'. A model whose full fp32 training state exceeds a per-rank
limit trains at stage 3 with offload and is OOM-killed at stage 0, the launcher naming the cause.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.distributed import run_world
from tests.launcher.helpers import DSLAUNCH, new_tag, tagged_env

WIDTH, LAYERS = 64, 6
LAYER = WIDTH * WIDTH + WIDTH
BUCKET = 1000  # reduce_bucket_size (elements): small, so the buckets do not hide a shard


def _measure(rank: int, world: int, stage: int, zero: dict) -> dict:
    import torch

    import dslaunch
    from dslaunch.runtime.zero.reducer import MAX_INFLIGHT_BUFFERS
    from tests.runtime.zero.held import held_bytes, held_storages

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())])
    # gloo: the shared-memory slots are a fixed cost per group (2 x ranks x up to 8 MiB, test_shm.py),
    # not the per-parameter memory measured here
    cfg = {"train_batch_size": 8, "shared_memory_collectives": "never",
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": BUCKET, **zero}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    working: list[int] = []
    for m in model:
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda m, a: working.append(held_bytes(engine)))
            m.weight.register_hook(lambda g: working.append(held_bytes(engine)))
    torch.manual_seed(1)
    for _ in range(3):  # the first step records the trace; the others prefetch and reuse
        engine.backward(engine(torch.randn(8 // world, WIDTH)).square().mean())
        engine.step()
    state = [t for st in engine.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    masters = {g.master.data_ptr() for g in engine.zero.groups}
    storages = held_storages(engine)
    return {"rest": held_bytes(engine), "peak": max(working),
            "comm": engine.zero.held_bytes()["comm_buffers"],
            "comm_bound": (MAX_INFLIGHT_BUFFERS + 2) * max(BUCKET, WIDTH * WIDTH) * 4,  # a bucket fits a param
            "state_on_cpu": all(t.device.type == "cpu" for t in state),
            "state_of_masters": {p.data_ptr() for p in engine.optimizer.state} == masters,
            "state_counted": all(t.untyped_storage().data_ptr() in storages for t in state),
            "state_on_device": sum(t.numel() * t.element_size() for t in state
                                   if t.device != torch.device("cpu"))}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_stage3_holds_a_shard_of_stage0_plus_the_live_parameters(world: int) -> None:
    """stage 3 at rest = stage 0's weights and optimizer state / N, no gradient and no reduce
    bucket (a few bytes of step counters aside); while it runs, the whole parameters add at most max_live_parameters (2 layers here), while
    unbounded settings keep the whole model alive (the bound is what holds it down)."""
    zero0 = run_world(_measure, world, 0, {})
    live = 2 * LAYER
    bounded = run_world(_measure, world, 3, {"stage3_max_live_parameters": live,
                                             "stage3_prefetch_bucket_size": LAYER})
    free = run_world(_measure, world, 3, {})
    total = LAYERS * LAYER * 4  # bytes of the model's weights
    for s0, s3, unbounded in zip(zero0, bounded, free, strict=True):
        assert s0["rest"] >= 4 * total  # weights, gradients, two Adam moments
        assert s3["comm"] == 0  # the reduce buckets were freed with the gradient shard
        slack = 64 + 16 * world  # step counters; the last rank's shard rounding
        held = s0["rest"] - total  # stage 0 without its gradient buffer: weights and Adam moments
        assert held / world - slack <= s3["rest"] <= held / world + slack
        # while running: the live parameters, the gradient shard and the reduce buckets
        assert 0 < s3["peak"] - s3["rest"] <= live * 4 + total / world + s3["comm_bound"]
        assert unbounded["peak"] - unbounded["rest"] >= total


@pytest.mark.timeout(120)
def test_cpu_offload_keeps_the_optimizer_state_off_the_device() -> None:
    """offload_optimizer cpu: every optimizer-state tensor is held in host memory and belongs to
    the offloaded fp32 master (on a GPU host: no optimizer byte on the device)."""
    for r in run_world(_measure, 2, 3, {"offload_optimizer": {"device": "cpu"}}):
        assert r["state_on_cpu"] and r["state_of_masters"] and r["state_counted"]
        assert r["state_on_device"] == 0


CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
SCRIPT = str(Path(__file__).parent / "bin" / "cgroup_train.py")
PARAMS = 12 * 1024 * 1024  # 12 layers of 1024 x 1024: 192 MiB of fp32 weights + grads + Adam moments
LIMIT = 176 << 20  # per rank, on what it allocates after importing torch; stage 3 measured ~137 MiB


def _cgroup_prefix() -> str:
    prefix = f"dslaunch-memory-{uuid.uuid4().hex[:8]}"
    probe = CGROUP_ROOT / f"{prefix}-probe"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup v1 memory group under {CGROUP_ROOT} ({exc}): needs root "
                    "and the v1 memory controller")
    return prefix


def _train_limited(tmp_path: Path, port: int, zero: dict) -> tuple[subprocess.CompletedProcess, list[int]]:
    """4 ranks under dslaunch, each in its own cgroup limited to LIMIT; returns the run and the peaks."""
    prefix = _cgroup_prefix()
    cfg = {"train_batch_size": 4, "shared_memory_collectives": "never",  # as in _measure
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"reduce_bucket_size": 1_000_000, **zero}}
    env = tagged_env(new_tag(), CGROUP_PREFIX=prefix, LIMIT_BYTES=str(LIMIT), PARAMS=str(PARAMS),
                     DS_CONFIG=json.dumps(cfg),
                     MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors go back to the kernel at once
    try:
        run = subprocess.run([*DSLAUNCH, "--num_gpus", "4", "--master_port", str(port), "--log_dir",
                              str(tmp_path / "logs"), SCRIPT], env=env, capture_output=True, text=True,
                             timeout=240)
    finally:
        for rank in range(4):
            path = CGROUP_ROOT / f"{prefix}-rank{rank}"
            if path.exists():
                path.rmdir()
    peaks = [int(line.split()[-1]) for line in run.stdout.splitlines() if " peak " in line]
    return run, peaks


@pytest.mark.timeout(300)
def test_a_model_over_the_memory_limit_trains_at_stage3_and_is_oom_killed_at_stage0(tmp_path, free_port) -> None:
    """Each rank may allocate 176 MiB; the model's fp32 weights + gradients + Adam moments are
    192 MiB. Stage 3 (CPU offload, live parameters bounded) trains; stage 0 is OOM-killed and the
    launcher reports it as out of memory, with the remedies."""
    assert PARAMS * 16 > LIMIT
    run, peaks = _train_limited(tmp_path / "z3", free_port, {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_max_live_parameters": 3_000_000,
        "stage3_prefetch_bucket_size": 1_000_000})
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(peaks) == 4 and max(peaks) < LIMIT, run.stdout
    run, peaks = _train_limited(tmp_path / "z0", free_port, {"stage": 0})
    assert run.returncode != 0, run.stderr[-3000:]
    assert "killed by SIGKILL" in run.stderr and "out of memory: try a higher ZeRO stage" in run.stderr, \
        run.stderr[-3000:]
    assert peaks == []
