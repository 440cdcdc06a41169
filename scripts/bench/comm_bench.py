"""Less traffic on slow links (issue 26): bytes per step and step time of plain Adam, the 1-bit
optimizers, ZeRO-3 and ZeRO++, flat and hierarchical, on the namespace cluster, in one run.

2 hosts x 2 ranks of the test cluster (``scripts/cluster/cluster.py``; ranks started in the hosts'
namespaces by ``netns_ranks.py``), each host's link shaped (tc token bucket both ways; restored to
what it was afterwards), ranks on one host over loopback. The model is a ~59M-parameter language
model (``Model``; 8 tokens per rank, so communication dominates), fp32. Rows (``ROWS``), each
compared with its baseline measured at the same link rate in the same call:

- ``optimizers`` (default link 200 Mbit/s), ZeRO stage 0: ``Adam`` (a flat fp32 all-reduce,
  ``hierarchical_allreduce: never``), ``Adam hierarchical`` (``topology``: it picks the
  hierarchical all-reduce for 2 hosts of 2 ranks), ``OneBitAdam``, ``ZeroOneAdam``, ``Lamb`` and
  ``OneBitLamb`` (against ``Lamb``). The warm-up steps are the 1-bit optimizers' (``freeze_step``,
  ``var_freeze_step`` = ``--warmup``): the measured steps are compressed ones, in their steady
  state (``Row.ramp`` more steps run untimed): OneBitAdam's and OneBitLamb's first compressed step
  allocates their error feedback and whole momentum (~3x a later step's time, measured); ZeroOneAdam
  (``local_step_clipper`` 2) synchronises its first 2 local steps, then every 2nd (an even ``--steps``
  measures whole periods; DeepSpeed's default clipper, 16, would synchronise 8x less often).
- ``zero`` (default link 1 Gbit/s), Adam at ZeRO stage 3 with ``stage3_max_reuse_distance: 0`` and
  10M of ``stage3_max_live_parameters`` and prefetch (backward gathers its parameters again, as for
  a model too large to keep whole between forward and backward, which is where stage 3 is used):
  ``ZeRO-3 flat``, ``ZeRO-3`` (the hierarchical all-reduce, the topology's default and the
  baseline of the ZeRO++ rows), ``qwZ``, ``qgZ``, ``hpZ`` (one ZeRO++ key each) and ``ZeRO++`` (all
  three; hpZ over the host's 2 ranks).

Bytes: (1) sent per rank and step, from the collective payloads the comms logger sees: each
payload times the share of it that leaves a rank of its group on average (all-reduce 2(n-1)/n,
all-gather and reduce-scatter n-1, all-to-all, broadcast and reduce (n-1)/n, n the group's size);
(2) cross-node bytes per step: what the hosts' links carried, from each host's ``eth0`` transmit
counter around the measured steps (payload plus TCP/IP headers). Time: the mean wall time of the
measured steps on rank 0.

Usage (as root, under both locks; keep a call under 10 minutes: split the rows over calls, then
merge): ``/tmp/dsl/bench-quiet flock /tmp/dslaunch-cluster.lock .venv/bin/python
scripts/bench/comm_bench.py [--rows optimizers|zero|NAME,...] [--link-rate RATE] [--steps 2]
[--out-suffix S]``; a row's baseline joins the call if not named. ``--merge A.json B.json ...``
makes one report of several calls. Writes ``results/comm_bench[_S].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
CLUSTER = HERE.parent / "cluster"
PER_HOST = 2
VOCAB, DIM, HIDDEN, LAYERS, TOKENS = 8192, 1024, 4096, 5, 8
LINK = {"optimizers": "200mbit", "zero": "1gbit"}  # each group's default: where communication dominates

# parameters re-gathered in backward: at most 10M whole at once (a model that does not fit whole)
ZERO3 = (("stage", 3), ("stage3_max_reuse_distance", 0), ("stage3_max_live_parameters", 10_000_000),
         ("stage3_prefetch_bucket_size", 10_000_000))
QWZ, QGZ = ("zero_quantized_weights", True), ("zero_quantized_gradients", True)
HPZ = ("zero_hpz_partition_size", PER_HOST)


class Model(torch.nn.Module):
    """An 8192 x 1024 embedding, 5 blocks of a 1024 -> 4096 -> 1024 MLP, a 1024 x 8192 head: 58.8M."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, DIM))
            for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        for block in self.blocks:
            h = h + block(h)
        return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def optimizer(name: str, warmup: int) -> dict:
    """The ds_config ``optimizer`` section of ``name``; the 1-bit ones compress after ``warmup`` steps."""
    params = {"Adam": {}, "Lamb": {}, "OneBitAdam": {"freeze_step": warmup},
              "OneBitLamb": {"freeze_step": warmup},
              # variance frozen after the warm-up; then local steps, a 1-bit sync every 2nd from the 2nd
              "ZeroOneAdam": {"var_freeze_step": warmup, "var_update_scaler": 1, "local_step_scaler": 1,
                              "local_step_clipper": 2}}[name]
    return {"type": name, "params": {"lr": 1e-4, **params}}


@dataclass(frozen=True)
class Row:
    """One configuration: its optimizer, ZeRO keys and gradient all-reduce, and its baseline row."""

    name: str
    group: str  # a key of LINK
    optimizer: str
    baseline: str | None = None
    hierarchical: str = "never"  # hierarchical_allreduce
    zero: tuple[tuple[str, object], ...] = ()
    ramp: int = 0  # untimed steps after the warm-up, before the optimizer's schedule is steady

    def config(self, warmup: int) -> dict:
        return {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10_000,
                "comms_logger": {"enabled": True}, "optimizer": optimizer(self.optimizer, warmup),
                "hierarchical_allreduce": self.hierarchical,
                "zero_optimization": dict(self.zero) or {"stage": 0}}


ROWS = {r.name: r for r in (
    Row("Adam", "optimizers", "Adam"),
    Row("Adam hierarchical", "optimizers", "Adam", "Adam", "topology"),
    Row("OneBitAdam", "optimizers", "OneBitAdam", "Adam", ramp=1),
    Row("ZeroOneAdam", "optimizers", "ZeroOneAdam", "Adam", ramp=2),
    Row("Lamb", "optimizers", "Lamb", "Adam"),
    Row("OneBitLamb", "optimizers", "OneBitLamb", "Lamb", ramp=1),
    Row("ZeRO-3 flat", "zero", "Adam", None, "never", ZERO3),
    Row("ZeRO-3", "zero", "Adam", "ZeRO-3 flat", "topology", ZERO3),
    Row("qwZ", "zero", "Adam", "ZeRO-3", "topology", (*ZERO3, QWZ)),
    Row("qgZ", "zero", "Adam", "ZeRO-3", "topology", (*ZERO3, QGZ)),
    Row("hpZ", "zero", "Adam", "ZeRO-3", "topology", (*ZERO3, HPZ)),
    Row("ZeRO++", "zero", "Adam", "ZeRO-3", "topology", (*ZERO3, QWZ, QGZ, HPZ)),
)}


def _share(op: str, n: int) -> float:
    """The share of a payload that leaves a rank of a group of ``n``, averaged over its ranks."""
    if op.startswith("all_reduce") or op == "inference_all_reduce":
        return 2 * (n - 1) / n  # a ring: reduce-scatter, then all-gather
    if op.startswith(("all_gather", "reduce_scatter")):
        return n - 1.0  # each rank's piece reaches the n - 1 others
    if op in ("all_to_all_single", "broadcast", "reduce"):
        return (n - 1) / n  # each of the n - 1 other ranks' pieces (or copies) crosses once
    return 1.0 if n > 1 else 0.0


class SentBytes:
    """The bytes this rank's collectives send, from the payloads the comms logger records and the
    sizes of their groups: it wraps the logger's ``append``, the one place that sees the group's
    size (its summary keeps only names and payload sizes). Records arrive from gloo's threads too."""

    def __init__(self, logger: object) -> None:
        self.sent = 0.0
        self._lock = threading.Lock()
        original = logger.append

        def append(raw: str, record: str, latency_ms: float, size: int, n: int, rank: int = 0) -> None:
            with self._lock:
                self.sent += size * _share(raw, n)
            original(raw, record, latency_ms, size, n, rank)

        logger.append = append

    def reset(self) -> None:
        with self._lock:
            self.sent = 0.0


def measure(cfg: dict, warmup: int, steps: int, at_warmup: Callable[[], None] = lambda: None,
            at_end: Callable[[], None] = lambda: None) -> dict:
    """Worker side (collective): train ``Model`` under ``cfg`` for ``warmup + steps`` steps of random
    tokens; ``at_warmup`` runs before the first measured step, ``at_end`` after the last (both on
    every rank). Returns the measured steps' seconds, every loss, and per rank and measured step
    the bytes sent, the logged payload and each op's count."""
    from ranks import timed_steps

    import dslaunch
    from dslaunch import comm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine, _, _, _ = dslaunch.initialize(model=Model(), config=cfg)
    counter = SentBytes(comm.comms_logger)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))

    def start() -> None:
        at_warmup()
        comm.comms_logger.reset()
        counter.reset()

    times, losses = timed_steps(engine, lambda: torch.randint(0, VOCAB, (1, TOKENS + 1), generator=g), warmup,
                                steps, start)
    summary = comm.comms_logger.summary()
    sent = counter.sent
    at_end()
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    engine.destroy()
    payload = sum(size * row["count"] for sizes in summary.values() for size, row in sizes.items())
    return {"step_s": times, "losses": losses, "params": params, "sent": sent / steps,
            "payload": payload / steps,
            "ops": {op: sum(r["count"] for r in sizes.values()) // steps for op, sizes in summary.items()}}


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, CLUSTER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def _retransmits() -> int:
    """TCP segments this host (network namespace) sent again: a shaped link dropped packets."""
    lines = Path("/proc/net/snmp").read_text().splitlines()
    head, values = (ln.split() for ln in lines if ln.startswith("Tcp:"))
    return int(values[head.index("RetransSegs")])


def worker(name: str, warmup: int, steps: int) -> None:
    """One rank on a cluster host: ``measure`` plus this host's outgoing link bytes and retransmits."""
    import torch.distributed as dist
    from ranks import report

    link = [0, 0]

    def at_warmup() -> None:
        dist.barrier()
        link[:] = _tx_bytes(), _retransmits()

    def at_end() -> None:
        dist.barrier()  # every rank of a host reads the same counters
        link[:] = _tx_bytes() - link[0], _retransmits() - link[1]

    values = measure(ROWS[name].config(warmup), warmup + ROWS[name].ramp, steps, at_warmup, at_end)
    report({**values, "local_rank": int(os.environ["LOCAL_RANK"]), "tx": link[0], "retrans": link[1]})


def run(name: str, hosts: list[dict], per_host: int, warmup: int, steps: int, timeout: float) -> dict:
    """Row ``name`` on ``hosts`` (``per_host`` ranks each): its numbers per step."""
    results = _script("netns_ranks").run_on_hosts(
        hosts, per_host, [sys.executable, __file__, "--worker", name, str(warmup), str(steps)], timeout,
        env={"PYTHONPATH": f"{HERE}:{HERE.parents[1]}", "DS_ACCELERATOR": "cpu"})
    line = next((ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        bad = next((r for r in results if r.returncode != 0), results[0])
        raise SystemExit(f"comm_bench: {name}: rank {bad.rank} exited {bad.returncode}: {bad.stderr[-3000:]}")
    per_rank = json.loads(line[len("RESULT "):])
    return {"params": per_rank[0]["params"], "untimed_steps": warmup + ROWS[name].ramp,
            "cross_node_bytes_per_step": sum(r["tx"] for r in per_rank if r["local_rank"] == 0) / steps,
            "sent_bytes_per_rank_step": sum(r["sent"] for r in per_rank) / len(per_rank),
            "payload_bytes_per_rank_step": sum(r["payload"] for r in per_rank) / len(per_rank),
            "step_s": sum(per_rank[0]["step_s"]) / steps, "step_s_rank0": per_rank[0]["step_s"],
            "tcp_retransmits_per_step": sum(r["retrans"] for r in per_rank if r["local_rank"] == 0) / steps,
            "losses_rank0": per_rank[0]["losses"],
            "ops_per_step_rank0": per_rank[0]["ops"]}


def compare(rows: list[dict]) -> None:
    """Each row against its baseline measured in the same call at the same link rate (in place)."""
    for row in rows:
        base = next((b for b in rows if b["name"] == row["baseline"] and b["call"] == row["call"]
                     and b["link"] == row["link"]), None)
        for key, ratio in (("sent_vs_baseline", "sent_bytes_per_rank_step"),
                           ("cross_node_vs_baseline", "cross_node_bytes_per_step")):
            row[key] = row[ratio] / base[ratio] if base else None
        row["speedup_vs_baseline"] = base["step_s"] / row["step_s"] if base else None


def chosen(spec: str) -> list[str]:
    """The rows ``--rows`` names (row or group names, comma-separated) plus their baselines, in
    ``ROWS`` order; a one-line error for an unknown name."""
    names = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        group = [n for n, r in ROWS.items() if r.group == item]
        if not group and item not in ROWS:
            raise SystemExit(f"comm_bench: --rows: no row or group {item!r}; rows: {', '.join(ROWS)}; "
                             f"groups: {', '.join(LINK)}")
        names.update(group or [item])
    names.update(ROWS[n].baseline for n in list(names) if ROWS[n].baseline)
    return [n for n in ROWS if n in names]


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt) + "x"


def markdown(result: dict) -> str:
    """The report: how each call ran, the table, and the issue's targets met or not."""
    rows = result["rows"]
    lines = [f"{result['hosts']} hosts x {result['ranks_per_host']} ranks of the namespace cluster, "
             f"{rows[0]['params'] / 1e6:.1f}M params (fp32), {result['warmup']} warm-up and "
             f"{result['steps']} measured steps per row; links shaped per host (tc token bucket, "
             "both ways)."]
    ramps = [f"{r['name']} {r['untimed_steps'] - result['warmup']}" for r in rows
             if r.get("untimed_steps", result["warmup"]) > result["warmup"]]
    if ramps:
        lines.append(f"Untimed steps after the warm-up, before the optimizer's steady state: {', '.join(ramps)}.")
    lines.append("")
    lines += [f"- call {c['call']}: {c['started']}, {c['seconds']:.0f} s, load average (1 min) "
              f"{c['load'][0]:.2f} -> {c['load'][1]:.2f}" for c in result["calls"]]
    lines += ["", "| call | link | row | baseline | sent / rank / step | vs baseline | cross-node / step "
              "| vs baseline | step (s) | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['call']} | {r['link']} | {r['name']} | {r['baseline'] or '-'} | "
              f"{r['sent_bytes_per_rank_step'] / 1e6:.2f} MB | {_cell(r['sent_vs_baseline'], '.3f')} | "
              f"{r['cross_node_bytes_per_step'] / 1e6:.1f} MB | "
              f"{_cell(r['cross_node_vs_baseline'], '.3f')} | "
              f"{r['step_s']:.2f} | {_cell(r['speedup_vs_baseline'], '.2f')} |" for r in rows]
    return "\n".join(lines + ["", *targets(rows)]) + "\n"


def targets(rows: list[dict]) -> list[str]:
    """Issue 26's targets, each row that has the numbers for one."""
    out = []
    for r in rows:
        if r["name"] in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb") and r["sent_vs_baseline"]:
            fewer, faster = 1 / r["sent_vs_baseline"], r["speedup_vs_baseline"]
            out.append(f"- {r['name']} ({r['link']}, against {r['baseline']}): {fewer:.1f}x fewer bytes sent "
                       f"({'met' if fewer >= 30 else 'missed'}: >= 30x), {faster:.2f}x faster "
                       f"({'met' if faster >= 3 else 'missed'}: >= 3x where communication dominates)")
        if r["name"] == "ZeRO++" and r["cross_node_vs_baseline"]:
            x = r["cross_node_vs_baseline"]
            out.append(f"- ZeRO++ ({r['link']}): cross-node bytes {x:.3f}x of ZeRO-3's "
                       f"({'met' if x <= 0.25 else 'missed'}: <= 0.25x)")
    return out


def _write(result: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / f"{stem}.md").write_text(text)
    print(text)


def merge(parts: list[Path]) -> dict:
    """One report of several calls' JSON files: calls renumbered in the order given."""
    loaded = [json.loads(p.read_text()) for p in parts]
    calls, rows = [], []
    for part in loaded:
        number = {c["call"]: len(calls) + i for i, c in enumerate(part["calls"], 1)}
        calls += [{**c, "call": number[c["call"]]} for c in part["calls"]]
        rows += [{**r, "call": number[r["call"]]} for r in part["rows"]]
    return {**loaded[0], "calls": calls, "rows": rows}


def measure_on_cluster(names: list[str], link: str | None, warmup: int, steps: int, per_host: int = PER_HOST) -> dict:
    """The rows ``names`` on hosts 1-2 of the test cluster, one call; each group's link rate (or
    ``link``) set while its rows run. The cluster and its links are left as they were found."""
    cluster = _script("cluster")
    state = cluster.state_dir_default()
    was_up = all(cluster.status(state)["sshd"].get(f"{cluster.PREFIX}node{k}") for k in (1, 2))
    hosts = _script("netns_ranks").first_hosts(cluster, 2)
    before = json.loads((state / "state.json").read_text()).get("link") or {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0, start, rows = os.getloadavg()[0], time.monotonic(), []
    try:
        for name in names:
            rate = link or LINK[ROWS[name].group]
            cluster.reshape(state, cluster.LinkShape(rate))
            rows.append({"name": name, "baseline": ROWS[name].baseline, "link": rate, "call": 1,
                         **run(name, hosts, per_host, warmup, steps, timeout=540)})
            print({k: v for k, v in rows[-1].items() if k != "losses_rank0"}, flush=True)
    finally:
        if was_up:
            cluster.reshape(state, cluster.LinkShape(before.get("rate"), before.get("delay")))
        else:
            cluster.down(state)
    call = {"call": 1, "started": started, "seconds": time.monotonic() - start,
            "load": [round(load0, 2), round(os.getloadavg()[0], 2)], "rows": names, "ranks_per_host": per_host}
    return {"hosts": 2, "ranks_per_host": per_host, "warmup": warmup, "steps": steps,
            "torch": torch.__version__, "calls": [call], "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(LINK),
                    help="row or group names, comma-separated (default: all)")
    ap.add_argument("--link-rate", default=None,
                    help="every row's link rate (tc units; default: the group's)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=PER_HOST, choices=(1, PER_HOST),
                    help="1: world 2, a core per rank (optimizer rows without the hierarchical one)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--out-suffix", default="", help="appended to the result files' names (split calls)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="one report of these calls' results")
    args = ap.parse_args()
    if args.merge:
        if missing := [str(p) for p in args.merge if not p.is_file()]:
            raise SystemExit(f"comm_bench: --merge: no such file: {', '.join(missing)}")
        result = merge(args.merge)
    else:
        if args.warmup < 1 or args.steps < 1:
            raise SystemExit("comm_bench: --warmup and --steps must be at least 1 "
                             "(the 1-bit optimizers warm up)")
        names = chosen(args.rows)
        if args.ranks_per_host == 1 and (bad := [n for n in names if ROWS[n].group != "optimizers"
                                                 or ROWS[n].hierarchical != "never"]):
            raise SystemExit(f"comm_bench: --ranks-per-host 1: rows {', '.join(bad)} need ranks that share "
                             "a host (ZeRO++'s hpZ, the hierarchical all-reduce)")
        result = measure_on_cluster(names, args.link_rate, args.warmup, args.steps, args.ranks_per_host)
    compare(result["rows"])
    _write(result, args.out, "comm_bench" + (f"_{args.out_suffix}" if args.out_suffix else ""))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        raise SystemExit(0)
    raise SystemExit(main())
