"""The heartbeat wire format: what a worker tells its node agent about its progress.

Shared by the worker side (``dslaunch.runtime.heartbeat`` writes beats) and the launcher (the
agent reads them, the controller judges them), so the runtime never imports the launcher.
Torch-free, standard library only.

One beat is one JSON line, at most ``MAX_LINE`` bytes, written with a single ``write`` to a
pipe: lines under PIPE_BUF (4096 on Linux) are atomic, so several threads (or forked data-loader
children that inherited the pipe) never interleave inside a line.

The channel, set up by the agent for every worker (see ``launcher/workerenv.py``):

- ``DSLAUNCH_HEARTBEAT_FD``: write end of a pipe; the worker writes beats there;
- ``DSLAUNCH_STACK_FD``: write end of a second pipe; the worker registers ``faulthandler`` on
  ``STACK_SIGNAL`` to dump every thread's stack there (a separate pipe because faulthandler writes
  a line in several pieces from a signal handler, which beats from another thread could split).
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["Beat", "Memory", "ExpertExchange", "HEARTBEAT_FD_ENV", "STACK_FD_ENV", "STACK_SIGNAL", "CHECKPOINT_SIGNAL", "MAX_LINE",
           "MAX_HANG_TIMEOUT", "MIN_HANG_TIMEOUT"]

HEARTBEAT_FD_ENV = "DSLAUNCH_HEARTBEAT_FD"
STACK_FD_ENV = "DSLAUNCH_STACK_FD"
STACK_SIGNAL = signal.SIGUSR2
MAX_HANG_TIMEOUT = 7 * 24 * 3600.0
"""The longest hang timeout the controller judges beats against (``--hang_timeout`` and the
ds_config ``monitor.hang_timeout``): a week; beyond, hang detection is as good as off."""
MIN_HANG_TIMEOUT = 2.0
"""The shortest hang timeout: a rank's progress reaches the controller up to 1 s late (the
worker's sender thread ticks every 0.5 s, a remote agent's beats line every 0.5 s), so a shorter
one kills healthy jobs; 2 s leaves that delay twice over."""
"""The signal a worker's stack dump answers to. Sent only to workers whose beats say they
registered it (``Beat.stack_signal``): its default action would kill the process."""
CHECKPOINT_SIGNAL = signal.SIGUSR1
"""The signal that asks a rank for a checkpoint (pre-emption). Sent only to ranks whose beats say
they handle it (``Beat.checkpoint_signal``): its default action would kill the process."""
MAX_LINE = 4000  # under PIPE_BUF: one atomic write


@dataclass(frozen=True)
class Memory:
    """One rank's memory: its GPU's (NVML) or, without NVML, the process RSS (``kind='rss'``)."""

    kind: str
    """``gpu`` or ``rss``."""
    used: int
    """Bytes this process uses (on its GPU for ``gpu``)."""
    peak: int
    """The largest ``used`` seen so far."""
    total: int | None = None
    """The GPU's memory (``gpu`` only)."""


@dataclass(frozen=True)
class Beat:
    """One progress report of one rank."""

    rank: int
    seq: int
    """Counts the rank's beats; a new number means the rank is alive (even if ``step`` is not)."""
    step: int | None = None
    """The last finished training step; None before the first (the rank is up)."""
    samples_per_s: float | None = None
    loss: float | None = None
    memory: Memory | None = None
    stack_signal: int | None = None
    """The signal that makes this rank dump its stacks into its stack pipe (None: it cannot)."""
    pid: int | None = None
    checkpoint_signal: int | None = None
    """The signal that asks this rank for a checkpoint (None: it does not take requests)."""
    phase: str | None = None
    """Not a training step: ``checkpoint`` (saving or loading) or ``exit`` (the script is done and
    the process is leaving). The monitor gives a phase the first step's allowance."""
    waiting: str | None = None
    """The collective or wait the engine issued that the main thread is in (``gradient
    all_reduce``), None when it is in none: a rank waiting for its peers is not the one they wait
    for (``runtime.heartbeat.waiting``)."""
    waiting_s: float | None = None
    """How long it had been in ``waiting`` when the beat was sent (its own clock: a duration, so
    no clock is compared across hosts)."""
    tokens_per_s: float | None = None
    """Training tokens per second of the whole job as this rank sees them (its own x the
    data-parallel size, like ``samples_per_s``); None: no token ids seen."""
    mfu: float | None = None
    """This rank's model FLOP/s over its device's peak (0..1); None: FLOPs or peak unknown."""
    mfu_from: str | None = None
    """How the FLOPs were counted: ``profiled`` (the flops profiler's step) or ``6N*tokens``."""
    activity: str | None = None
    """What the engine is doing, in words, when it says (a pipeline stage's instruction: ``stage 2
    waiting to receive activations of micro-batch 5 from stage 1``); None: nothing said."""
    raised: str | None = None
    """The exception this rank raised (``Type: message``, one line), sent the moment it was raised
    (``runtime.heartbeat.Heartbeat.raised``): before its peers fail for lack of it and before its
    own teardown, so the launcher blames the first rank that raised, not the first to exit."""
    raised_at: float | None = None
    """When it raised (``time.time()`` on the rank's host)."""
    raised_trace: str | None = None
    """The end of its traceback (bounded: the whole one comes from the rank's stderr if it gets
    to print it)."""
    memory_checkpoint: dict[str, Any] | None = None
    """In-memory checkpoints (``runtime.checkpoint.memory``): ``host``, ``step`` (the newest complete
    snapshot) and ``bytes`` (its host's store) from each host's first rank, and once after a restart
    ``restored``: ``{"source", "step", "storage_step"}`` from rank 0."""

    def to_line(self) -> bytes:
        """One JSON line (newline included), never over ``MAX_LINE`` bytes."""
        data = json.dumps(asdict(self), separators=(",", ":")).encode() + b"\n"
        if len(data) <= MAX_LINE:
            return data
        if self.raised_trace:  # what it raised matters more than the rest: keep it, drop the trace
            return replace(self, raised_trace=None).to_line()
        return Beat(self.rank, self.seq, self.step, raised=self.raised, raised_at=self.raised_at).to_line()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Beat:
        """Inverse of ``to_dict``; unknown keys are ignored (a newer worker)."""
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in raw.items() if k in names}
        mem = known.get("memory")
        if isinstance(mem, dict):
            known["memory"] = Memory(**{k: v for k, v in mem.items() if k in {f.name for f in fields(Memory)}})
        return cls(**known)

    @classmethod
    def from_line(cls, line: bytes | str) -> Beat | None:
        """The beat on one line, or None for a line that is not one (never raises)."""
        try:
            raw = json.loads(line)
            return cls.from_dict(raw) if isinstance(raw, dict) else None
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class ExpertExchange:
    """An MoE layer's all-to-all over its expert group, as the name of a wait (``Beat.waiting``):
    ``moe all_to_all (dispatch) of layer 3, experts 0-7 on ranks 4-7``. The worker names the whole
    group (made once per layer); the monitor reads it back (``parse``) and names the experts the
    waiting rank waits for (``name(ranks)``: those on the ranks that are not in it).

    ``phase``: ``dispatch``, ``combine``, or either followed by ``, backward``; ``layer``: the MoE
    layer's index in the model (DeepSpeed's ``moe_layer_id``), None when not numbered; ``ranks``:
    the expert group's global ranks in group order (group rank ``i`` holds experts
    ``i * experts_per_rank`` to ``(i + 1) * experts_per_rank - 1``).
    """

    phase: str
    layer: int | None
    ranks: tuple[int, ...]
    experts_per_rank: int

    def __str__(self) -> str:
        return self.name(self.ranks)

    def name(self, ranks: Collection[int]) -> str:
        """The exchange named by the experts on ``ranks`` (those of its group among them)."""
        held = [r for r in self.ranks if r in ranks]
        n = self.experts_per_rank
        experts = [self.ranks.index(r) * n + j for r in held for j in range(n)]
        layer = f" of layer {self.layer}" if self.layer is not None else ""
        return (f"moe all_to_all ({self.phase}){layer}, expert{'s' * (len(experts) != 1)} {_spans(experts)} "
                f"on rank{'s' * (len(held) != 1)} {_spans(held)}")

    @classmethod
    def parse(cls, text: str | None) -> ExpertExchange | None:
        """The exchange a wait's name describes (its whole group, as ``str`` writes it), or None."""
        m = _EXCHANGE.match(text or "")
        if m is None:
            return None
        ranks, experts = _unspans(m["ranks"]), _unspans(m["experts"])
        if not ranks or len(experts) % len(ranks):
            return None
        layer = int(m["layer"]) if m["layer"] is not None else None
        return cls(m["phase"], layer, tuple(ranks), len(experts) // len(ranks))


_EXCHANGE = re.compile(r"^moe all_to_all \((?P<phase>[^)]+)\)(?: of layer (?P<layer>\d+))?, "
                       r"experts? (?P<experts>[\d,-]+) on ranks? (?P<ranks>[\d,-]+)$")


def _spans(numbers: Iterable[int]) -> str:
    """``0-3,8,10-11``: runs of consecutive numbers, in the order given."""
    runs: list[list[int]] = []
    for x in numbers:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _unspans(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or int(last or first) - int(first) > _MAX_SPAN:
            return []
        out += range(int(first), int(last or first) + 1)
    return out


_MAX_SPAN = 1 << 20  # more ranks or experts than any job has: not a name the runtime wrote
