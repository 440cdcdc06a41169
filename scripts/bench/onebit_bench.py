"""1-bit optimizers and the hierarchical all-reduce: bytes sent per step and step time, in one run.

``comm_bench``'s ~59M-parameter language model and optimizer rows (``comm_bench.ROWS``, group
``optimizers``) on ``--world`` local gloo ranks (one thread each) with a tiny batch (8 tokens per
rank), so the gradient exchange dominates the step; ``comm_bench`` runs the same rows on 2 hosts x 2
ranks of the namespace cluster. Each configuration runs ``--warmup`` steps (the 1-bit optimizers'
warm-up: ``freeze_step`` = that) and then ``--steps`` measured steps:

- ``Adam`` and ``Lamb``: fp32 all-reduce of the gradients (flat: ``hierarchical_allreduce: never``);
- ``Adam hierarchical``: the same through ``hierarchical_allreduce: topology`` with the ranks split
  into 2 pretend nodes (``NODE_RANK``), world 4 on loopback only;
- ``OneBitAdam`` and ``OneBitLamb``: the measured steps are compressed ones (the first, which
  allocates their error feedback, untimed: ``comm_bench.Row.ramp``);
- ``ZeroOneAdam``: variance frozen after the warm-up, the measured steps local ones with a 1-bit
  synchronisation every 2nd step (its first 2 local steps, both synchronised, untimed).

Bytes: ``comm_bench.SentBytes``: every collective's payload as the comms logger records it, times
the share of it that leaves a rank of its group (all-reduce 2(n-1)/n, all-to-all, broadcast and
reduce (n-1)/n, all-gather n-1 of its input; n the group's size), per rank and step. Every row is
compared with Adam. Time: the mean wall time of the measured steps on rank 0. Without a shaped
link the ranks talk over loopback (~0.8 GB/s for gloo at world 2 here: FACTS.md), which already
makes the fp32 exchange the larger part of a step.

Writes ``results/onebit_bench_w<world>[_shaped_<rate>].json`` and ``.md``. Run it under the benchmark lock:
``flock /tmp/dslaunch-bench.lock python scripts/bench/onebit_bench.py [--world 2] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp
from comm_bench import ROWS, TOKENS, measure

HERE = Path(__file__).resolve().parent


def configs(world: int, warmup: int) -> dict[str, dict]:
    """``comm_bench``'s optimizer rows; the hierarchical one at world 4 only (2 pretend nodes of 2)."""
    return {r.name: r.config(warmup) for r in ROWS.values()
            if r.group == "optimizers" and (world == 4 or r.hierarchical == "never")}


def _chosen(all_configs: dict[str, dict], only: list[str] | None) -> dict[str, dict]:
    """The configurations ``--only`` names (Adam first, always: the rows are compared with it)."""
    if not only:
        return all_configs
    names = ["Adam", *(n for n in dict.fromkeys(only) if n != "Adam")]
    unknown = [n for n in names if n not in all_configs]
    if unknown:
        raise SystemExit(f"--only: unknown configuration {unknown[0]!r}; valid: {', '.join(all_configs)}")
    return {n: all_configs[n] for n in names}


def run(rank: int, world: int, port: int, name: str, cfg: dict, warmup: int, steps: int, queue: object,
        master: str = "127.0.0.1", per_node: int = 2) -> None:
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                      NODE_RANK=str(rank // per_node))
    values = measure(cfg, warmup + ROWS[name].ramp, steps)  # the optimizer's steady state, as comm_bench
    if rank == 0:
        queue.put({"name": name, "params": values["params"], "bytes_per_step": values["sent"],
                   "step_s": sum(values["step_s"]) / steps, "ops": values["ops"]})
    import torch.distributed as dist

    dist.destroy_process_group()


class _FileQueue:
    """Rank 0's result into a file (a rank started in a network namespace by ``ip netns exec``)."""

    def __init__(self, path: str):
        self.path = path

    def put(self, row: dict) -> None:
        Path(self.path).write_text(json.dumps(row))


def _worker(argv: list[str]) -> None:
    rank, world, port, name, warmup, steps, master, out = argv
    cfg = configs(int(world), int(warmup))[name]
    run(int(rank), int(world), int(port), name, cfg, int(warmup), int(steps), _FileQueue(out), master, per_node=1)


class ShapedHosts:
    """``world`` private network namespaces (one rank each) on a bridge, each link shaped by
    ``cluster.LinkShape`` (a token bucket both ways). Not the test cluster's names: it may be in use."""

    def __init__(self, world: int, rate: str):
        import importlib.util
        import sys

        spec = importlib.util.spec_from_file_location("cluster", HERE.parent / "cluster" / "cluster.py")
        self.cl = importlib.util.module_from_spec(spec)
        sys.modules["cluster"] = self.cl  # dataclasses look their module up there
        spec.loader.exec_module(self.cl)
        self.hosts = [self.cl.Host(f"dslob-n{k}", f"10.213.77.{10 + k}") for k in range(world)]
        self.shape = self.cl.LinkShape(rate)

    def __enter__(self) -> ShapedHosts:
        run_ = self.cl._run
        run_("ip", "link", "add", "dslob-br", "type", "bridge")
        run_("ip", "addr", "add", "10.213.77.1/24", "dev", "dslob-br")
        run_("ip", "link", "set", "dslob-br", "up")
        for h in self.hosts:
            run_("ip", "netns", "add", h.name)
            run_("ip", "link", "add", f"{h.name}v", "type", "veth", "peer", "name", f"{h.name}p")
            run_("ip", "link", "set", f"{h.name}p", "netns", h.name)
            run_("ip", "-n", h.name, "link", "set", f"{h.name}p", "name", h.iface)
            run_("ip", "link", "set", f"{h.name}v", "master", "dslob-br", "up")
            run_("ip", "-n", h.name, "addr", "add", f"{h.addr}/24", "dev", h.iface)
            run_("ip", "-n", h.name, "link", "set", h.iface, "up")
            run_("ip", "-n", h.name, "link", "set", "lo", "up")
            self.cl._shape_link(h, self.shape)
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.hosts:
            self.cl._run("ip", "netns", "del", h.name, check=False)
        self.cl._run("ip", "link", "del", "dslob-br", check=False)

    def run(self, name: str, warmup: int, steps: int, port: int) -> dict:
        import subprocess
        import sys
        import tempfile

        out = tempfile.mktemp(suffix=".json")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(["ip", "netns", "exec", h.name, sys.executable, __file__, "--worker", str(r),
                                   str(len(self.hosts)), str(port), name, str(warmup), str(steps),
                                   self.hosts[0].addr, out], env=env)
                 for r, h in enumerate(self.hosts)]
        for p in procs:
            p.wait(timeout=1800)
        return json.loads(Path(out).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, choices=(2, 4))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--out-suffix", default="", help="appended to the result files' names (split runs)")
    ap.add_argument("--only", action="append", default=None, metavar="NAME",
                    help="run this configuration (repeatable; Adam, the baseline, always runs first)")
    ap.add_argument("--link-rate", default=None,
                    help="one rank per private network namespace, each link shaped to this rate (tc units, e.g. 1gbit)")
    args = ap.parse_args()
    from dslaunch.utils.ports import free_port

    ctx = mp.get_context("spawn")
    chosen = _chosen(configs(args.world, args.warmup), args.only)
    rows = []
    if args.link_rate:
        with ShapedHosts(args.world, args.link_rate) as hosts:
            for name in chosen:
                if "hierarchical" not in name:  # one rank per host: nothing to do within a node
                    rows.append(hosts.run(name, args.warmup, args.steps, free_port()))
                    print(rows[-1], flush=True)
    for name, cfg in chosen.items() if not args.link_rate else ():
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=run, args=(r, args.world, port, name, cfg, args.warmup, args.steps, queue))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        rows.append(queue.get(timeout=1800))
        for p in procs:
            p.join()
        print(rows[-1], flush=True)
    adam = rows[0]
    for row in rows:
        row["bytes_vs_adam"] = adam["bytes_per_step"] / row["bytes_per_step"]
        row["speedup_vs_adam"] = adam["step_s"] / row["step_s"]
    result = {"world": args.world, "warmup": args.warmup, "steps": args.steps, "tokens_per_rank": TOKENS,
              "link": f"{args.link_rate} per host (tc token bucket, both ways)" if args.link_rate else "loopback",
              "loadavg_1m": os.getloadavg()[0], "torch": torch.__version__,
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = (f"onebit_bench_w{args.world}" + (f"_shaped_{args.link_rate}" if args.link_rate else "")
            + (f"_{args.out_suffix}" if args.out_suffix else ""))
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"world {args.world}, {rows[0]['params'] / 1e6:.1f}M params, link {result['link']}, "
             f"load average {result['loadavg_1m']:.1f}",
             "", "| config | bytes sent per rank and step | vs Adam | step time (s) | speed-up vs Adam |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['bytes_per_step'] / 1e6:.2f} MB | {r['bytes_vs_adam']:.1f}x fewer | "
              f"{r['step_s']:.3f} | {r['speedup_vs_adam']:.2f}x |" for r in rows]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
        raise SystemExit(0)
    raise SystemExit(main())
