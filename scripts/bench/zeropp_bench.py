"""ZeRO++ against ZeRO-3 on the namespace cluster: bytes per step and step time, in one run.

2 hosts x 2 ranks of the test cluster (``scripts/cluster/cluster.py``; ranks started in the hosts'
namespaces by ``netns_ranks.py``), each host's link shaped with ``--link-rate`` (tc token bucket both
ways; restored to what it was afterwards). The model is ``onebit_bench``'s ~59M-parameter language
model (8 tokens per rank, so communication dominates), fp32, Adam, ZeRO stage 3 with
``stage3_max_reuse_distance: 0`` and 10M of ``stage3_max_live_parameters`` and prefetch (backward
gathers its parameters again, as for a model too large to keep whole between forward and backward,
which is where stage 3 is used). Configurations:

- ``ZeRO-3``: fp32 broadcasts for the gathers, fp32 all-reduce of the gradients;
- ``qwZ``, ``qgZ``, ``hpZ``: one ZeRO++ key each; ``ZeRO++``: all three (hpZ over the host's 2 ranks).

Bytes: (1) the collective payloads each rank logged (the comms logger: every call's tensor bytes,
all ranks, per step and rank); (2) cross-node bytes: what the hosts' links carried, read from each
host's ``eth0`` transmit counter around the measured steps (payload plus TCP/IP headers), per step.
Time: the mean wall time of the measured steps on rank 0.

Writes ``results/zeropp_bench.json`` and ``.md``. Run as root under both locks:
``/tmp/dsl/bench-quiet flock /tmp/dslaunch-cluster.lock .venv/bin/python scripts/bench/zeropp_bench.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
CLUSTER = HERE.parent / "cluster"
PER_HOST = 2

# parameters re-gathered in backward: at most 10M whole at once (a model that does not fit whole)
ZERO3 = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 10_000_000,
         "stage3_prefetch_bucket_size": 10_000_000}
CONFIGS = {
    "ZeRO-3": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "hpZ": {"zero_hpz_partition_size": PER_HOST},
    "ZeRO++": {"zero_quantized_weights": True, "zero_quantized_gradients": True,
               "zero_hpz_partition_size": PER_HOST},
}


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, CLUSTER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def worker(name: str, warmup: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from onebit_bench import TOKENS, VOCAB, Model
    from ranks import report, timed_steps

    import dslaunch
    from dslaunch import comm

    torch.set_num_threads(1)
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10_000, "comms_logger": {"enabled": True},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "zero_optimization": {**ZERO3, **CONFIGS[name]}}
    torch.manual_seed(0)
    engine, _, _, _ = dslaunch.initialize(model=Model(), config=cfg)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    tx0 = [0]

    def at_warmup() -> None:
        dist.barrier()
        comm.comms_logger.reset()
        tx0[0] = _tx_bytes()

    times, losses = timed_steps(engine, lambda: torch.randint(0, VOCAB, (1, TOKENS + 1), generator=g), warmup,
                                steps, at_warmup)
    summary = comm.comms_logger.summary()
    dist.barrier()
    tx = _tx_bytes() - tx0[0]  # this host's outgoing link: every rank of the host reads the same counter
    payload = sum(size * row["count"] for sizes in summary.values() for size, row in sizes.items())
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    engine.destroy()
    report({"local_rank": int(os.environ["LOCAL_RANK"]), "tx": tx, "payload": payload, "step_s": times,
            "losses": losses, "params": params,
            "ops": {op: sum(r["count"] for r in sizes.values()) // steps for op, sizes in summary.items()}})


def run(name: str, hosts: list[dict], warmup: int, steps: int, timeout: float) -> dict:
    ranks = _script("netns_ranks")
    results = ranks.run_on_hosts(hosts, PER_HOST, [sys.executable, __file__, "--worker", name, str(warmup), str(steps)],
                                 timeout, env={"PYTHONPATH": f"{HERE}:{HERE.parents[1]}", "DS_ACCELERATOR": "cpu"})
    line = next((ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        bad = next((r for r in results if r.returncode != 0), results[0])
        raise SystemExit(f"zeropp_bench: {name}: rank {bad.rank} exited {bad.returncode}: {bad.stderr[-3000:]}")
    per_rank = json.loads(line[len("RESULT "):])
    cross = sum(r["tx"] for r in per_rank if r["local_rank"] == 0)  # one reading per host
    return {"name": name, "params": per_rank[0]["params"], "cross_node_bytes_per_step": cross / steps,
            "payload_bytes_per_rank_step": sum(r["payload"] for r in per_rank) / len(per_rank) / steps,
            "step_s": sum(per_rank[0]["step_s"]) / steps, "losses_rank0": per_rank[0]["losses"],
            "ops_per_step_rank0": per_rank[0]["ops"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link-rate", default="1gbit", help="each host's link rate (tc units)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    cluster = _script("cluster")
    hosts = _script("netns_ranks").first_hosts(cluster, 2)
    state = cluster.state_dir_default()
    before = json.loads((state / "state.json").read_text()).get("link") or {}
    cluster.reshape(state, cluster.LinkShape(args.link_rate))
    rows = []
    try:
        for name in args.configs.split(","):
            rows.append(run(name, hosts, args.warmup, args.steps, timeout=400))
            print({k: v for k, v in rows[-1].items() if k != "losses_rank0"}, flush=True)
    finally:
        cluster.reshape(state, cluster.LinkShape(before.get("rate"), before.get("delay")))
    base = rows[0]
    for row in rows:
        row["cross_node_vs_zero3"] = row["cross_node_bytes_per_step"] / base["cross_node_bytes_per_step"]
        row["speedup_vs_zero3"] = base["step_s"] / row["step_s"]
    result = {"hosts": 2, "ranks_per_host": PER_HOST, "link": f"{args.link_rate} per host (tc token bucket, both ways)",
              "warmup": args.warmup, "steps": args.steps, "loadavg_1m": os.getloadavg()[0], "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zeropp_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"2 hosts x {PER_HOST} ranks, {rows[0]['params'] / 1e6:.1f}M params (fp32), link {result['link']}, "
             f"{args.steps} measured steps, load average {result['loadavg_1m']:.1f}", "",
             "| config | cross-node bytes / step | vs ZeRO-3 | payload / rank / step | step time (s) | speed-up |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['cross_node_bytes_per_step'] / 1e6:.1f} MB | {r['cross_node_vs_zero3']:.3f}x | "
              f"{r['payload_bytes_per_rank_step'] / 1e6:.1f} MB | {r['step_s']:.2f} | {r['speedup_vs_zero3']:.2f}x |"
              for r in rows]
    (args.out / "zeropp_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        raise SystemExit(0)
    raise SystemExit(main())
