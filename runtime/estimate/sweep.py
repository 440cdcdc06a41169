"""Every ZeRO stage x offload x precision for one model and cluster, sorted by what fits: the table
of ``dslaunch estimate``.

Each row is one setup estimated twice, without and with activation checkpointing. With a device
memory given, rows that fit without checkpointing come first, then those that fit only with it,
then the rest; within the first two groups the likely fastest first (less offloading, then a lower
stage: each step up adds communication), the rest by device peak, closest to fitting first.
Without a device memory, rows are sorted by the device peak.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from dslaunch.runtime.estimate.memory import MemoryEstimate, estimate_memory
from dslaunch.runtime.estimate.setup import TrainingSetup
from dslaunch.runtime.estimate.shape import ModelShape

__all__ = ["Row", "setups", "sweep", "sort_rows", "format_table", "rows_as_json", "format_bytes"]

_OFFLOAD_COST = {"none": 0, "cpu": 1, "nvme": 2}
GiB = 2**30


@dataclass(frozen=True)
class Row:
    """One setup: estimated without (``plain``) and with (``checkpointed``) activation checkpointing."""

    plain: MemoryEstimate
    checkpointed: MemoryEstimate

    @property
    def setup(self) -> TrainingSetup:
        return self.plain.setup

    def fit(self, device_memory: int | None, host_memory: int | None = None) -> str:
        """``yes``, ``ckpt`` (only with activation checkpointing), ``no``, or ``""`` without a limit."""
        if device_memory is None:
            return ""
        if self.plain.fits(device_memory, host_memory):
            return "yes"
        return "ckpt" if self.checkpointed.fits(device_memory, host_memory) else "no"


def setups(base: TrainingSetup, stages: Iterable[int] = (0, 1, 2, 3),
           precisions: Iterable[str] = ("bf16",), offload_devices: Iterable[str] = ("none", "cpu", "nvme"),
           ) -> list[TrainingSetup]:
    """Every valid setup: ``base`` with each stage, precision and offload (optimizer from stage 1,
    parameters at stage 3, and parameters only with the optimizer offloaded too, as DeepSpeed's
    table)."""
    devices = list(offload_devices)
    out = []
    for precision in precisions:
        for stage in stages:
            for opt in devices if stage >= 1 else ["none"]:
                for par in devices if stage == 3 else ["none"]:
                    if par != "none" and opt == "none":
                        continue
                    out.append(base.with_(stage=stage, precision=precision, offload_optimizer=opt,
                                          offload_param=par, activation_checkpointing=False))
    return out


def sweep(shape: ModelShape, candidates: Iterable[TrainingSetup]) -> list[Row]:
    """Each candidate estimated without and with activation checkpointing."""
    return [Row(estimate_memory(shape, s), estimate_memory(shape, s.with_(activation_checkpointing=True)))
            for s in candidates]


def sort_rows(rows: Iterable[Row], device_memory: int | None = None, host_memory: int | None = None) -> list[Row]:
    """Rows in the order of the module docstring."""
    group = {"yes": 0, "ckpt": 1, "no": 2, "": 0}

    def key(r: Row) -> tuple:
        s = r.setup
        peak = r.plain.device_bytes if r.fit(device_memory, host_memory) != "ckpt" else r.checkpointed.device_bytes
        fit = r.fit(device_memory, host_memory)
        if device_memory is None or fit == "no":
            return (group[fit], 0, 0, peak)
        return (group[fit], _OFFLOAD_COST[s.offload_optimizer] + _OFFLOAD_COST[s.offload_param], s.stage, peak)
    return sorted(rows, key=key)


def format_bytes(n: int) -> str:
    """GiB with two decimals (DeepSpeed's tables say GB for the same unit)."""
    return f"{n / GiB:.2f}"


def _describe(shape: ModelShape, s: TrainingSetup) -> list[str]:
    dims = [f"{shape.params / 1e6:,.1f}M parameters", f"largest layer {shape.largest_layer / 1e6:,.1f}M"]
    if shape.expert_params:
        dims.append(f"{shape.expert_params / 1e6:,.1f}M in "
                    + (f"{shape.num_experts} experts a layer" if shape.num_experts else "experts"))
    if shape.transformer:
        dims.append(f"hidden {shape.hidden}, {shape.layers} layers, {shape.heads or '?'} heads, "
                    f"vocab {shape.vocab or '?'}")
    work = f"micro batch {s.micro_batch}" + (f", sequence {s.seq_len}" if s.seq_len else "")
    return [f"Model{' ' + shape.name if shape.name else ''}: {', '.join(dims)}",
            f"Cluster: {s.nodes} node(s) x {s.gpus_per_node} GPU(s); data parallel {s.data_parallel}, "
            f"pipeline {s.pipeline}, tensor {s.tensor} (a what-if)"
            + (f", sequence parallel {s.sequence}" if s.sequence > 1 else "")
            + (f", expert parallel {s.expert_parallel}" if s.expert_parallel > 1 else "")
            + f"; {work}; optimizer {s.optimizer}"]


def format_table(shape: ModelShape, rows: list[Row], device_memory: int | None = None,
                 host_memory: int | None = None) -> str:
    """The table ``dslaunch estimate`` prints: per-GPU and per-node GiB of each setup."""
    head = ("stage", "offload_opt", "offload_param", "dtype", "GPU states", "GPU +act", "GPU +act ckpt",
            "node CPU", "node NVMe")
    shared = any(r.plain.shm.total for r in rows)  # CPU ranks on one host: what /dev/shm must hold
    if shared:
        head = (*head, "node /dev/shm")
    if device_memory is not None:
        head = (*head, f"fits {format_bytes(device_memory)}GiB")
    known = bool(rows) and rows[0].plain.activations_known
    body = []
    for r in rows:
        s, p, c = r.setup, r.plain, r.checkpointed
        act = (format_bytes(p.device_bytes), format_bytes(c.device_bytes)) if known else ("-", "-")
        cells = (str(s.stage), s.offload_optimizer, s.offload_param, s.precision,
                 format_bytes(p.device.model_states), *act, format_bytes(p.host_bytes), format_bytes(p.nvme.total))
        cells = (*cells, format_bytes(p.shm.total)) if shared else cells
        body.append((*cells, r.fit(device_memory, host_memory)) if device_memory is not None else cells)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = _describe(shape, rows[0].setup) if rows else []
    lines.append("GiB per GPU and per node (all its GPUs' host memory and NVMe files)"
                 + ("; CPU ranks: 'GPU' is a rank's private memory, /dev/shm the shared segments of all "
                    "(docker run --shm-size)" if shared else ""))
    for cells in (head, *body):
        lines.append("  ".join(x.rjust(w) for x, w in zip(cells, widths, strict=True)).rstrip())
    if not known:
        lines.append("Activations not estimated: give the model's hidden size and layers (a Hugging Face config "
                     "has them) and --seq_len; 'fits' counts model states only.")
    return "\n".join(lines)


def rows_as_json(rows: list[Row], device_memory: int | None = None, host_memory: int | None = None) -> list[dict]:
    """The rows for tools: setup fields, bytes by purpose (device, host, NVMe) both ways, the fit."""
    def one(e: MemoryEstimate) -> dict:
        return {"device_bytes": e.device_bytes, "host_bytes": e.host_bytes, "nvme_bytes": e.nvme.total,
                "shm_bytes": e.shm.total, "device": e.device.as_dict(), "host": e.host.as_dict(),
                "nvme": e.nvme.as_dict(), "shm": e.shm.as_dict(), "host_init_bytes": e.host_init}
    return [{"setup": {k: v for k, v in asdict(r.setup).items() if k != "activation_checkpointing"},
             "activations_known": r.plain.activations_known, "plain": one(r.plain),
             "checkpointed": one(r.checkpointed), "fits": r.fit(device_memory, host_memory) or None}
            for r in rows]
