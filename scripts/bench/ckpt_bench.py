"""Checkpoint benchmark: save/load throughput vs the disk, async-save stall, and DeepSpeed.

One run, one model for everyone: a ~19.3M-parameter MLP (6 x Linear(1792, 1792)), fp32, AdamW,
ZeRO stage 2, 2 ranks on gloo, so a checkpoint holds ~308 MB (module weights + fp32 master +
two Adam moments), the size DeepSpeed was measured at here before. Each system runs as 2 fresh
worker processes started with the launcher's env contract, OMP_NUM_THREADS=1:

- save: ``save_checkpoint`` under a new tag, from a barrier to a barrier (dslaunch: fsynced,
  published, ``latest`` replaced; DeepSpeed does not fsync);
- load: ``load_checkpoint`` of that tag into the live engine (page cache warm for both; one
  untimed load first, so one-off imports are not counted);
- the same save with ``checkpoint.fsync: false`` (row "dslaunch fsync=false"): DeepSpeed's
  durability, for a like-for-like time;
- async (dslaunch only): how long the training loop is blocked with ``checkpoint.async_save``
  (the ``save_checkpoint`` call plus the time the next optimizer step waits for the snapshot
  copy), as a fraction of a synchronous save;
- disk: ``dd conv=fsync`` of the same number of bytes to the same file system.

Each measured tag is deleted before the next save (for both systems, like ``keep_last``): on
this VM, writing into never-touched memory (a growing page cache) costs ~5x more than the save.

``--rounds`` alternating runs of each system with ``--repeats`` saves and loads each; medians
and minimums over all repeats. Timings on a shared 2-core machine are
noisy; the table says so and records the load average.

Usage: python scripts/bench/ckpt_bench.py [--repeats 3] [--rounds 2]
Writes scripts/bench/results/ckpt_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dslaunch.utils.ports import free_port

HERE = Path(__file__).resolve().parent
DIM, LAYERS, MICRO, WORLD, LR = 1792, 6, 8, 2, 1e-4
NOFSYNC = "dslaunch fsync=false"  # checkpoint.fsync: false, DeepSpeed's durability


def _ds_config(peer: bool, async_save: bool = False, fsync: bool = True) -> dict:
    params = {"lr": LR, "weight_decay": 0.01}
    if peer:
        params["torch_adam"] = True  # FusedAdam needs CUDA; torch's AdamW on CPU
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": params},
           "zero_optimization": {"stage": 2}}
    if not peer:
        cfg["checkpoint"] = {"async_save": async_save, "fsync": fsync}
    return cfg


# ----- worker side ----------------------------------------------------------------------------
def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])


def _timed(fn, dist) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(kind: str, root: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if kind == "deepspeed":
        import deepspeed as ds
    else:
        import dslaunch as ds
    rank = int(os.environ["RANK"])
    model = _model()
    engine, _, _, _ = ds.initialize(model=model, config=_ds_config(kind == "deepspeed",
                                                                    fsync=kind != NOFSYNC),
                                    model_parameters=model.parameters())
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)

    def train(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        return (time.perf_counter() - t0) / steps

    train(2)  # optimizer state exists from here on
    saves, loads = [], []
    engine.save_checkpoint(root, tag="warmup")
    engine.load_checkpoint(root, tag="warmup")
    nbytes = _tag_bytes(root, "warmup")
    _drop(root, "warmup", dist)
    for i in range(repeats):
        saves.append(_timed(lambda i=i: engine.save_checkpoint(root, tag=f"sync{i}"), dist))
        loads.append(_timed(lambda i=i: engine.load_checkpoint(root, tag=f"sync{i}"), dist))
        _drop(root, f"sync{i}", dist)
    result = {"save_s": saves, "load_s": loads, "bytes": nbytes}
    if kind == "deepspeed":  # the same durability as dslaunch: its files fsynced before returning
        result["durable_save_s"] = [_timed(lambda i=i: _save_and_fsync(engine, root, f"durable{i}", dist),
                                           dist) for i in range(repeats)]
    if kind == "dslaunch":
        result.update(_async_stall(engine, root, repeats, train, dist))
    out = [None] * WORLD
    dist.all_gather_object(out, result)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _save_and_fsync(engine, root: str, tag: str, dist) -> None:
    engine.save_checkpoint(root, tag=tag)
    dist.barrier()
    if dist.get_rank() == 0:
        for f in sorted((Path(root) / tag).rglob("*")):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
    _drop(root, tag, dist)


def _tag_bytes(root: str, tag: str) -> int:
    return sum(f.stat().st_size for f in (Path(root) / tag).rglob("*") if f.is_file())


def _drop(root: str, tag: str, dist) -> None:
    """Delete a measured tag (as keep_last would): each save then reuses freed page-cache
    memory instead of touching fresh VM memory, which costs more than the save itself here."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(Path(root) / tag, ignore_errors=True)
    dist.barrier()


def _async_stall(engine, root: str, repeats: int, train, dist) -> dict:
    """Blocking time of async saves, and training step time while the writer runs."""
    import dataclasses

    from dslaunch.runtime.checkpoint import wait_for_checkpoint

    cfg = engine._config
    engine._config = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                            async_save=True))
    step_alone = statistics.median(train(1) for _ in range(3))
    stalls, during = [], []
    for i in range(repeats + 1):  # the first async save allocates the snapshot buffers
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(root, tag=f"async{i}")
        call = time.perf_counter() - t0
        gated = engine.checkpoint_parts().io.gate_wait_s  # the next optimizer step's wait
        during.append(train(2))
        stalls.append(call + engine.checkpoint_parts().io.gate_wait_s - gated)
        wait_for_checkpoint(engine)
        _drop(root, f"async{i}", dist)
    engine._config = cfg
    return {"async_stall_s": stalls[1:], "async_first_stall_s": stalls[0],
            "step_s": step_alone, "step_during_async_write_s": during[1:]}


# ----- driver side ----------------------------------------------------------------------------
def _run(kind: str, repeats: int) -> list[dict] | None:
    port = free_port()
    root = tempfile.mkdtemp(prefix=f"ckpt_bench_{kind}_", dir="/tmp")
    procs = []
    try:
        for r in range(WORLD):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r),
                   "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", kind, root,
                                           str(repeats)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  {kind} failed:\n{outs[0][1][-3000:]}", file=sys.stderr)
    return None


def _disk_write_s(nbytes: int) -> float:
    """Seconds for dd to write and fsync ``nbytes`` to the file system the checkpoints use."""
    path = tempfile.mktemp(prefix="ckpt_bench_dd_", dir="/tmp")
    block = 4 << 20
    try:
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}",
                        f"count={max(1, nbytes // block)}", "conv=fsync"], check=True,
                       capture_output=True)
        return (time.perf_counter() - t0) * nbytes / (max(1, nbytes // block) * block)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _has_deepspeed() -> bool:
    return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0


def _worst(ranks: list[dict], key: str) -> list[float]:
    """Per repeat, the slowest rank (a collective save is as slow as its slowest rank)."""
    return [max(r[key][i] for r in ranks) for i in range(len(ranks[0][key]))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=4, help="saves/loads per worker run")
    ap.add_argument("--rounds", type=int, default=4,
                    help="alternating runs of each system (fsync times vary a lot on a shared disk)")
    args = ap.parse_args()
    raw: dict = {"load_avg_start": os.getloadavg()[0], "disk_write_s": []}
    kinds = ["dslaunch", NOFSYNC] + (["deepspeed"] if _has_deepspeed() else [])
    runs: dict[str, list | None] = {}
    for _ in range(args.rounds):  # alternate, so background load hits both systems alike
        for kind in kinds:
            runs[kind] = _merge(runs.get(kind), _run(kind, args.repeats))
        nbytes = runs["dslaunch"][0]["bytes"] if runs.get("dslaunch") else 231_000_000
        raw["disk_write_s"] += [_disk_write_s(nbytes) for _ in range(2)]
    raw["runs"] = runs
    raw["load_avg_end"] = os.getloadavg()[0]
    _write(raw)


def _merge(old: list[dict] | None, new: list[dict] | None) -> list[dict] | None:
    """Per rank, the measurements of several runs as one list per key."""
    if old is None or new is None:
        return new if old is None else old
    as_list = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
    return [{k: (o[k] if k == "bytes" else as_list(o[k]) + as_list(n[k])) for k in o}
            for o, n in zip(old, new, strict=True)]


def _write(raw: dict) -> None:
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "ckpt_bench.json").write_text(json.dumps(raw, indent=1))
    disk_s = statistics.median(raw["disk_write_s"])
    rows, summary = [], {}
    for kind, ranks in raw["runs"].items():
        if not ranks:
            continue
        nbytes = ranks[0]["bytes"]
        saves, loads = _worst(ranks, "save_s"), _worst(ranks, "load_s")
        save, load = statistics.median(saves), statistics.median(loads)
        summary[kind] = (save, load, nbytes)
        rows.append(f"| {kind} | {nbytes / 1e6:.0f} | {save:.3f} | {min(saves):.3f} | "
                    f"{nbytes / save / 1e9:.2f} | {load:.3f} | {min(loads):.3f} | {nbytes / load / 1e9:.2f} |")
    disk_gbs = summary["dslaunch"][2] / disk_s / 1e9 if "dslaunch" in summary else float("nan")
    lines = ["## Checkpoints (`ckpt_bench.py`)", "",
             f"ZeRO-2, 2 ranks (gloo), fp32 MLP of {LAYERS} x Linear({DIM}, {DIM}), AdamW; medians (and "
             f"minimum) of {len(raw['runs']['dslaunch'][0]['save_s']) if raw['runs'].get('dslaunch') else '?'} "
             f"repeats from alternating runs of each system, slowest rank per repeat. Shared 2-core VM: "
             f"noisy (load average "
             f"{raw['load_avg_start']:.1f} -> {raw['load_avg_end']:.1f}).", "",
             "| system | MB | save s | save min s | save GB/s | load s | load min s | load GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
             *rows, "",
             f"Disk sequential write (dd, fsync, same size, same file system): {disk_s:.3f} s = "
             f"{disk_gbs:.2f} GB/s.", ""]
    if "dslaunch" in summary:
        save, load, nbytes = summary["dslaunch"]
        lines.append(f"- dslaunch save throughput / disk write speed: **{disk_s / save:.2f}** "
                     "(target >= 0.5; dslaunch fsyncs every file)")
        ds = raw["runs"]["dslaunch"]
        stall = statistics.median(_worst(ds, "async_stall_s"))
        lines.append(f"- async save: the training loop is blocked {stall * 1e3:.1f} ms = "
                     f"**{stall / save:.3f}** of a synchronous save (target < 0.10); first async save "
                     f"(allocates the snapshot) {max(max(_list(r['async_first_stall_s'])) for r in ds) * 1e3:.0f} ms; "
                     f"a training step takes {statistics.median(x for r in ds for x in _list(r['step_s'])) * 1e3:.0f} ms "
                     f"alone and {statistics.median(_worst(ds, 'step_during_async_write_s')) * 1e3:.0f} ms "
                     "while the background write runs (2 cores shared)")
    if "dslaunch" in summary and "deepspeed" in summary:
        (s1, l1, _), (s2, l2, _) = summary["dslaunch"], summary["deepspeed"]
        durable = statistics.median(_worst(raw["runs"]["deepspeed"], "durable_save_s"))
        lines.append(f"- vs DeepSpeed {_ds_version()}: save time ratio dslaunch/DeepSpeed **{s1 / s2:.2f}**, "
                     f"load time ratio **{l1 / l2:.2f}** (< 1 = dslaunch faster; target <= 1). DeepSpeed "
                     f"does not fsync: its save returns while the data is still in the page cache. "
                     f"DeepSpeed's save followed by an fsync of its files takes {durable:.3f} s: "
                     f"dslaunch/that = **{s1 / durable:.2f}**; async save stalls training "
                     f"**{statistics.median(_worst(raw['runs']['dslaunch'], 'async_stall_s')) / s2:.3f}** "
                     "of DeepSpeed's save time. Which plain save is faster varies from run to run here "
                     "(DeepSpeed's un-synced save is bound by memory copies into the page cache, "
                     "dslaunch's by the disk); for equal durability compare with the fsynced figure.")
    if NOFSYNC in summary and "deepspeed" in summary:
        (s1, l1, _), (s2, l2, _) = summary[NOFSYNC], summary["deepspeed"]
        lines.append(f"- like for like with DeepSpeed's durability (`checkpoint.fsync: false`: no fsync, "
                     f"still atomic, survives a killed process): save time ratio **{s1 / s2:.2f}**, load "
                     f"time ratio **{l1 / l2:.2f}** (target <= 1)")
    elif "dslaunch" in summary and "deepspeed" not in summary:
        lines.append("- DeepSpeed not importable here: no peer comparison in this run")
    (out / "ckpt_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _list(v: float | list[float]) -> list[float]:
    return v if isinstance(v, list) else [v]


def _ds_version() -> str:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:  # not installed: no version to show
        return "?"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
