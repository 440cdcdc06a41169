"""wandb and Comet from the engine, offline (no network): the run each writes is read back (wandb's
transaction log, Comet's offline archive) and holds rank 0's events at x = samples."""

from __future__ import annotations

import glob
import json
import os
import struct
import zipfile

import pytest

from tests.distributed import run_world
from tests.monitor.training import train

pytestmark = pytest.mark.timeout(240)


def _offline_run(rank: int, world: int, out: str) -> list[dict]:
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=out, WANDB_SILENT="true",
                      COMET_OFFLINE_DIRECTORY=f"{out}/comet", COMET_AUTO_LOG_ENV_DETAILS="false",
                      COMET_LOGGING_CONSOLE="error")
    os.chdir(out)  # comet_ml and wandb write their logs to the working directory
    import dslaunch
    from tests.runtime.models import make_model

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "wandb": {"enabled": True, "project": "dslaunch-test", "group": "g"},
           "comet": {"enabled": True, "project": "dslaunch-test", "online": False, "samples_log_interval": 8}}
    engine, *_ = dslaunch.initialize(model=make_model(), config=cfg)
    seen = train(engine, 4, rank, world)
    engine.monitor.close()  # wandb.finish, experiment.end
    return seen


def _wandb_records(path: str) -> list:
    """The records of a ``.wandb`` file: a 7-byte header, then leveldb-style 32 KiB blocks of
    chunks (crc, length, type: 1 full, 2 first, 3 middle, 4 last), each record a protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, chunk, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def test_wandb_and_comet_offline_runs_hold_rank_0s_events(tmp_path) -> None:
    out = str(tmp_path)
    seen = run_world(_offline_run, 2, out)[0]
    runs = glob.glob(f"{out}/wandb/offline-run-*/run-*.wandb")
    assert len(runs) == 1  # rank 0's only
    records = _wandb_records(runs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.run_group) == ("dslaunch-test", "g")
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    history = [h for h in history if "Train/Samples/lr" in h]  # not wandb's own system records
    assert [h["_step"] for h in history] == [s["samples"] for s in seen] == [4, 8, 12, 16]
    assert [h["Train/Samples/train_loss"] for h in history] == pytest.approx([s["loss"] for s in seen])
    assert [h["Train/Samples/lr"] for h in history] == pytest.approx([s["lr"] for s in seen])

    archives = glob.glob(f"{out}/comet/*.zip")
    assert len(archives) == 1
    messages = zipfile.ZipFile(archives[0]).read("messages.json").decode().splitlines()
    metrics = [json.loads(m)["payload"]["metric"] for m in messages if '"metric_msg"' in m]
    loss = [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "Train/Samples/train_loss"]
    # samples_log_interval 8: logged at 4, then not before 12
    assert [step for step, _ in loss] == [4, 12]
    assert [v for _, v in loss] == pytest.approx([seen[0]["loss"], seen[2]["loss"]])
