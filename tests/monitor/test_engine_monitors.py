"""The engine's monitors on real ranks: TensorBoard event files read back with tensorboard's own
reader and CSV files row by row, across a SIGKILL after the last checkpoint and a resume at
another world size; DeepSpeed's event names and values, x = samples, rank 0 only."""

from __future__ import annotations

import csv
import glob
import os
import signal

import pytest

from tests.distributed import _CTX, run_world
from tests.monitor.training import train

pytestmark = pytest.mark.timeout(180)

DS_EVENTS = ("train_loss", "lr", "loss_scale", "elapsed_time_ms_forward", "elapsed_time_ms_backward",
             "elapsed_time_ms_backward_inner", "elapsed_time_ms_backward_allreduce", "elapsed_time_ms_step")


def _config(out: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "wall_clock_breakdown": True,
            "fp16": {"enabled": True, "initial_scale_power": 8}, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
            "tensorboard": {"enabled": True, "output_path": out, "job_name": "run"},
            "csv_monitor": {"enabled": True, "output_path": out, "job_name": "run"}}


def _train(engine, steps: int, rank: int, world: int) -> list[dict]:
    return train(engine, steps, rank, world, seed=engine.global_steps + 1)


def _killed_after_checkpoint(out: str, ckpt: str) -> None:
    """One rank: 4 steps, a checkpoint, 2 more steps logged, then SIGKILL (nothing closed)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import torch

    import dslaunch
    from tests.runtime.models import make_model

    torch.set_num_threads(1)
    engine, *_ = dslaunch.initialize(model=make_model(), config=_config(out))
    _train(engine, 4, 0, 1)
    engine.save_checkpoint(ckpt)
    _train(engine, 2, 0, 1)
    engine.monitor.flush()  # what a kill loses is only what was still queued; make it nothing
    os.kill(os.getpid(), signal.SIGKILL)


def _port() -> int:
    from dslaunch.utils.ports import free_port

    return free_port()


def _resumed(rank: int, world: int, out: str, ckpt: str) -> list[dict]:
    import dslaunch
    from tests.runtime.models import make_model

    engine, *_ = dslaunch.initialize(model=make_model(), config=_config(out))
    engine.load_checkpoint(ckpt)
    seen = _train(engine, 3, rank, world)
    engine.monitor.flush()
    return seen


def _csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_and_csv_read_as_one_run_across_a_kill_and_a_resume(tmp_path) -> None:
    out, ckpt = str(tmp_path / "tb"), str(tmp_path / "ckpt")
    killed = _CTX.Process(target=_killed_after_checkpoint, args=(out, ckpt))
    killed.start()
    killed.join(120)
    assert killed.exitcode == -signal.SIGKILL
    first = _csv(f"{out}/run/Train_Samples_train_loss.csv")
    assert [int(r[0]) for r in first[1:]] == [2, 4, 6, 8, 10, 12]  # the killed attempt's 6 steps

    resumed = run_world(_resumed, 2, out, ckpt)[0]  # rank 0's steps: 2 ranks, 4 samples a step
    assert [s["samples"] for s in resumed] == [12, 16, 20]
    run = f"{out}/run"
    assert not os.path.exists(f"{out}/run.tmp") and len(glob.glob(f"{run}/events.out.tfevents.*")) == 2
    expected_x = [2, 4, 6, 8, 12, 16, 20]  # steps 5-6 of the killed attempt (x 10, 12) are gone
    scalars = _scalars(run)
    for name in DS_EVENTS + ("grad_norm", "samples_per_sec", "peak_memory_MiB"):
        rows = _csv(f"{run}/Train_Samples_{name}.csv")
        assert rows[0] == ["step", name]  # one header, DeepSpeed's
        # a rate needs a step before it in the same process: none at the first step of each attempt
        want = [x for x in expected_x if x not in (2, 12)] if name == "samples_per_sec" else expected_x
        assert [int(r[0]) for r in rows[1:]] == want, name
        tb = scalars[f"Train/Samples/{name}"]
        assert [step for step, _ in tb] == [int(r[0]) for r in rows[1:]]
        assert [v for _, v in tb] == pytest.approx([float(r[1]) for r in rows[1:]], rel=1e-6)
    # the values are the engine's (rank 0's loss, the first group's lr, the fp16 scale) at each step
    by_x = {int(r[0]): float(r[1]) for r in _csv(f"{run}/Train_Samples_train_loss.csv")[1:]}
    assert [by_x[s["samples"]] for s in resumed] == pytest.approx([s["loss"] for s in resumed], rel=1e-6)
    by_x = {int(r[0]): float(r[1]) for r in _csv(f"{run}/Train_Samples_lr.csv")[1:]}
    assert [by_x[s["samples"]] for s in resumed] == pytest.approx([s["lr"] for s in resumed], rel=1e-6)
    by_x = {int(r[0]): float(r[1]) for r in _csv(f"{run}/Train_Samples_loss_scale.csv")[1:]}
    assert [by_x[s["samples"]] for s in resumed] == [s["scale"] for s in resumed]
    assert "Train/Samples/tokens_per_sec" in scalars  # token ids of shape (batch, 6)
    # where the curve continues: a text marker at the checkpoint's samples, in both files
    assert _csv(f"{run}/Run_resume.csv") == [["step", "resume"], ["8", "resumed at step 4 (8 samples), restart 0"]]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run)
    acc.Reload()
    marks = acc.Tensors("Run/resume/text_summary")
    assert [(m.step, m.tensor_proto.string_val[0].decode()) for m in marks] == [
        (8, "resumed at step 4 (8 samples), restart 0")]


def _accumulating(rank: int, world: int, out: str, peak: float) -> dict:
    import dslaunch
    from tests.runtime.models import make_model

    # Set here: a forkserver started by an earlier test passes on its own environment, not ours.
    os.environ["DSLAUNCH_PEAK_FLOPS"] = str(peak)  # the ranks' device peak, for a known MFU

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "csv_monitor": {"enabled": True, "output_path": out, "job_name": f"rank{rank}"}}
    engine, *_ = dslaunch.initialize(model=make_model(), config=cfg)
    losses = [s["loss"] for s in train(engine, 6, rank, world)]
    engine.monitor.flush()
    return {"losses": losses}


def test_train_loss_is_the_window_mean_and_only_rank_0_writes(tmp_path) -> None:
    from tests.runtime.models import make_model

    out, peak = str(tmp_path), 1e9
    got = run_world(_accumulating, 2, out, peak)
    assert os.listdir(out) == ["rank0"]  # rank 1 created nothing (it would have written to rank1/)
    rows = _csv(f"{out}/rank0/Train_Samples_train_loss.csv")
    losses = got[0]["losses"]
    assert [int(r[0]) for r in rows[1:]] == [12, 24]  # 2 micro * 3 accumulation * 2 ranks per step
    assert [float(r[1]) for r in rows[1:]] == pytest.approx([sum(losses[:3]) / 3, sum(losses[3:]) / 3])
    tokens = _csv(f"{out}/rank0/Train_Samples_tokens_per_sec.csv")
    samples = _csv(f"{out}/rank0/Train_Samples_samples_per_sec.csv")
    # 6 tokens per sample (the batches' sequence length): the two rates agree at every step
    assert [float(t[1]) for t in tokens[1:]] == pytest.approx([6 * float(s[1]) for s in samples[1:]])
    # rank 0's 6N FLOPs per token over the same window: half the 2 ranks' tokens/s
    n = sum(p.numel() for p in make_model().parameters())
    mfu = _csv(f"{out}/rank0/Train_Samples_mfu.csv")
    assert [float(m[1]) for m in mfu[1:]] == pytest.approx([6 * n * float(t[1]) / 2 / peak for t in tokens[1:]])
    assert not os.path.exists(f"{out}/rank0/Train_Samples_elapsed_time_ms_forward.csv")  # no breakdown
    assert not os.path.exists(f"{out}/rank0/Train_Samples_loss_scale.csv")  # not fp16


def _reporting(rank: int, world: int, out: str) -> str:
    import torch

    import dslaunch
    from dslaunch.errors import UsageError

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "csv_monitor": {"enabled": True, "output_path": out, "job_name": "run"}}
    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(8, 4), config=cfg)
    for _ in range(4):  # float inputs only: nothing the engine could count as tokens by itself
        loss = engine(torch.randn(2, 8)).square().mean()
        engine.report_tokens(5)
        engine.backward(loss)
        engine.step()
    engine.monitor.flush()
    try:
        engine.report_tokens(-1)
    except UsageError as err:
        return str(err)
    return "no error"


def test_a_custom_loop_reports_its_tokens_for_tokens_per_sec(tmp_path) -> None:
    (error,) = run_world(_reporting, 1, str(tmp_path))
    assert error == "engine.report_tokens(-1): expected the number of tokens, an int >= 0"
    tokens = _csv(f"{tmp_path}/run/Train_Samples_tokens_per_sec.csv")
    samples = _csv(f"{tmp_path}/run/Train_Samples_samples_per_sec.csv")
    assert len(tokens) == 4  # the header and steps 2-4 (a rate needs the step before it)
    # 5 tokens and 2 samples a step: the rates agree at every step
    assert [float(t[1]) for t in tokens[1:]] == pytest.approx([2.5 * float(s[1]) for s in samples[1:]])
