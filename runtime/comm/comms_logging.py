"""DeepSpeed's ``deepspeed.utils.comms_logging``: what the comms logger records about each
collective, and its summary table.

A record is one operation: its name (``log_name``, or the op), the bytes each rank contributes,
the latency from issue to completion and the bandwidths derived from them, kept per name and per
message size in DeepSpeed's layout, ``comms_dict[name][size] = [count, latencies, algbws, busbws]``
(index i of the three lists is the i-th operation; scripts read it through ``get_raw_data``). Bandwidths follow nccl-tests (``algbw = bytes moved / time``; ``busbw`` scales it by
what each link carries), with the group's own size. Asynchronous operations are timed up to their
completion (a callback of their future), not made synchronous. Records may arrive from gloo's
threads, so ``append`` takes a lock.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CommsLogger", "convert_size", "calc_bw_log", "trim_mean", "message_size"]

_GATHERS = ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")
_ALL_REDUCES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced")
# op -> the argument (torch.distributed's name) holding what each rank contributes; else "tensor"
_PAYLOAD = {"all_gather_into_tensor": "input_tensor", "reduce_scatter": "output", "reduce_scatter_tensor": "output",
            "all_to_all_single": "input", "all_to_all": "input_tensor_list", "all_reduce_coalesced": "tensors",
            "barrier": None, "monitored_barrier": None,
            # Python objects, or a list of point-to-point ops: no tensor size to read
            "broadcast_object_list": None, "all_gather_object": None, "batch_isend_irecv": None}


def convert_size(size_bytes: int) -> str:
    """``1536`` -> ``"1.5 KB"`` (powers of 1024, as DeepSpeed's table prints sizes)."""
    if size_bytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB")
    i = min(int(math.log(size_bytes, 1024)), len(names) - 1)
    return f"{round(size_bytes / 1024**i, 2)} {names[i]}"


def message_size(op: str, arguments: dict[str, Any]) -> int:
    """The bytes one rank contributes to ``op`` called with ``arguments`` (bound by name)."""
    name = _PAYLOAD.get(op, "tensor")
    tensor = arguments.get(name) if name is not None else None
    if isinstance(tensor, (list, tuple)):
        return sum(t.element_size() * t.nelement() for t in tensor)
    return tensor.element_size() * tensor.nelement() if tensor is not None else 0


def calc_bw_log(op: str, size: int, duration_ms: float, n: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in Gbps of ``op`` moving ``size`` bytes per rank in ``duration_ms`` among ``n``."""
    if duration_ms <= 0:
        return 0.0, 0.0
    if op in _GATHERS:  # every rank ends with (or starts from) n pieces
        algbw = size * n / duration_ms
        busbw = algbw * (n - 1) / n
    elif op in _ALL_REDUCES:  # a reduce-scatter then an all-gather: 2 (n - 1) / n per byte
        algbw = size / duration_ms
        busbw = algbw * 2 * (n - 1) / n
    elif op in ("all_to_all_single", "all_to_all"):
        algbw = size / duration_ms
        busbw = algbw * (n - 1) / n
    else:  # broadcast, reduce, gather, scatter, point-to-point, barrier
        algbw = busbw = size / duration_ms
    return algbw * 8 / 1e6, busbw * 8 / 1e6  # bytes per ms -> Gbps


def trim_mean(values: list[float], trim: float = 0.1) -> float:
    """The mean without the lowest and highest ``trim`` fraction (outliers of a warm-up, a GC)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    cut = int(len(ordered) * trim)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


class CommsLogger:
    """What ``comms_logger`` counts; ``comm.py`` (``dslaunch.comm``) holds the one instance (DeepSpeed's
    module-level ``comms_logger``). Off until ``configure`` enables it."""

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.comms_dict: dict[str, dict[int, list]] = {}
        self._lock = threading.Lock()

    def configure(self, config: Any) -> None:
        """Take ``enabled``, ``verbose``, ``debug``, ``prof_all`` and ``prof_ops`` from ``config``
        (a ``CommsLoggerConfig``)."""
        self.enabled, self.verbose, self.debug = config.enabled, config.verbose, config.debug
        self.prof_all, self.prof_ops = config.prof_all, list(config.prof_ops)

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def wants(self, op: str, prof: bool) -> bool:
        return self.prof_all or prof or op in self.prof_ops

    def append(self, raw_name: str, record_name: str, latency_ms: float, msg_size: int, n: int,
               rank: int = 0) -> None:
        """Record one completed operation (any thread)."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency_ms, n)
        with self._lock:
            row = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
            row[0] += 1
            for values, value in zip(row[1:], (latency_ms, algbw, busbw), strict=True):
                values.append(value)
        if self.verbose and rank == 0:
            print(f"rank={rank} | comm op: {record_name} | time (ms): {latency_ms:.2f} | msg size: "
                  f"{convert_size(msg_size)} | algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", flush=True)

    def reset(self) -> None:
        with self._lock:
            self.comms_dict = {}

    reset_data = reset  # DeepSpeed's name

    def has_data(self) -> bool:
        """Whether any operation was recorded."""
        return bool(self.comms_dict)

    def get_operation_names(self) -> list[str]:
        """The recorded operation names, in first-recorded order."""
        with self._lock:
            return list(self.comms_dict)

    def get_total_operations(self) -> int:
        """How many operations were recorded, over every name and size."""
        with self._lock:
            return sum(row[0] for by in self.comms_dict.values() for row in by.values())

    def _rows(self) -> dict[str, dict[int, tuple[list[float], list[float], list[float]]]]:
        """A copy of every record's three lists (a summary must never reorder what was stored)."""
        with self._lock:
            return {name: {size: (list(r[1]), list(r[2]), list(r[3])) for size, r in by.items()}
                    for name, by in self.comms_dict.items()}

    def latencies(self) -> dict[tuple[str, int], list[float]]:
        """Each ``(name, size)``'s latencies in ms, in the order they completed."""
        return {(name, size): lat for name, by in self._rows().items() for size, (lat, _, _) in by.items()}

    def summary(self) -> dict:
        """``{name: {size: {count, total_latency, avg_latency, algbw, busbw}}}``, sorted."""
        rows = self._rows()
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for name in sorted(rows):
            for size in sorted(rows[name]):
                lat, algbw, busbw = rows[name][size]
                entry = {"count": len(lat), "total_latency": sum(lat), "avg_latency": trim_mean(lat),
                         "algbw": trim_mean(algbw), "busbw": trim_mean(busbw)}
                out.setdefault(name, {})[size] = entry
        return out

    def get_raw_data(self) -> dict[str, dict[int, list]]:
        """``{name: {size: [count, latencies, algbws, busbws]}}``: the records themselves (a shallow
        copy of the outer dict, as DeepSpeed's)."""
        return self.comms_dict.copy()

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """DeepSpeed's per-size statistics of one operation name (``count``, ``total_latency_ms``,
        ``avg_latency_ms``, ``tput_avg_gbps``, ``busbw_avg_gbps``, ``msg_size_bytes``,
        ``msg_size_str``; means trimmed as ``summary``'s), or None if it was never recorded."""
        entries = self.summary().get(operation_name)
        if entries is None:
            return None
        return {size: {"count": e["count"], "total_latency_ms": e["total_latency"],
                       "avg_latency_ms": e["avg_latency"], "tput_avg_gbps": e["algbw"],
                       "busbw_avg_gbps": e["busbw"], "msg_size_bytes": size, "msg_size_str": convert_size(size)}
                for size, e in entries.items()}

    def log_all(self, summary: dict, print_fn: Callable[[str], Any] = print) -> None:
        """Print ``summary`` as DeepSpeed's table (a straggler column when it has one)."""
        straggler = any("straggler" in e for by in summary.values() for e in by.values())
        cols = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                "busbw_avg (Gbps)"] + (["Total Straggler(ms)"] if straggler else [])
        print_fn("".join(f"{c: <20}" for c in cols))
        for name, by in summary.items():
            print_fn(name)
            for size, e in by.items():
                cells = [" ", convert_size(size), str(e["count"])] + [f"{e[k]:.2f}" for k in (
                    "total_latency", "avg_latency", "algbw", "busbw")]
                if straggler:
                    cells.append("n/a" if e.get("straggler") is None else f"{e['straggler']:.2f}")
                print_fn("".join(f"{c: <20}" for c in cells))
        sys.stdout.flush()
