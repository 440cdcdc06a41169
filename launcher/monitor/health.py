"""Every rank's health from its heartbeats: progress, liveness, hangs, and who is behind.

The controller feeds ``Health`` the latest beat of each rank (from every node handle) on each
turn of the gang loop, and stamps news with its own clock: no clock is compared across hosts.

Hang rule: a rank whose step has not moved for ``hang_timeout`` seconds is stalled; before its
first step it gets ``max(hang_timeout, FIRST_STEP_ALLOWANCE_S)`` from its first beat (the 'up'
beat sent at ``init_distributed``), as model building, data loading and the first compilation
take longer than a step; so does a rank whose beat names a phase that is not a step (a checkpoint
being saved or loaded, the process leaving after its script finished), from the moment it
entered or left that phase. A rank that never sent a beat (a script that does not use dslaunch's
runtime) is not judged.

Blame (``behind``): in a data-parallel job one stuck rank stalls all others in their next
collective, so every rank stops moving at once. The ones to name are those at the lowest step;
among those, a rank found stopped (SIGSTOP), then one that went silent (no beat at all: its
process is frozen), then one an MoE layer's all-to-all waits for (a member of a waiting rank's
expert group that is not in that exchange: it skipped it, or called another collective; the
beat names the layer and group, ``ExpertExchange``), then one that is not waiting for its peers.
A rank waits when its beat says so (``Beat.waiting``: the engine's collectives and waits, and
``dslaunch.comm``'s, mark themselves), or, for a collective the script calls on
``torch.distributed`` itself (nothing marks those), when its main thread's innermost frame is in
``torch.distributed``. Each filter applies only when it narrows the set. File paths alone cannot
tell: the engine waits in its own frames (``work.wait()`` in the gradient reducer), where a rank
stuck in the script's code is too.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dslaunch.utils.beat import Beat, ExpertExchange

__all__ = ["Health", "RankHealth", "top_frame", "waited_for", "FIRST_STEP_ALLOWANCE_S", "SILENT_AFTER_S"]

FIRST_STEP_ALLOWANCE_S = 60.0
SILENT_AFTER_S = 4.0
"""No beat for this long = silent (a live worker beats every 2 s, see runtime.heartbeat)."""


@dataclass
class RankHealth:
    """What the controller knows about one rank (times are the controller's monotonic clock)."""

    rank: int
    node: int
    """Index of the rank's node handle."""
    host: str
    beat: Beat | None = None
    up_at: float | None = None
    heard_at: float | None = None
    progressed_at: float | None = None
    progressed_wall: float | None = None
    """``time.time()`` at ``progressed_at``: when the rank was last known to move, for events."""
    heard_wall: float | None = None

    @property
    def step(self) -> int | None:
        return self.beat.step if self.beat is not None else None


class Health:
    """The ranks of one job. Not thread-safe: the gang loop owns it."""

    def __init__(self, ranks: Iterable[tuple[int, int, str]], hang_timeout: float | None) -> None:
        """``ranks``: (global rank, node index, host) of every worker."""
        self.ranks = {r: RankHealth(r, node, host) for r, node, host in ranks}
        self.hang_timeout = hang_timeout

    def update(self, beats: Mapping[int, Beat], now: float | None = None) -> list[int]:
        """Take the latest beats; return the ranks heard from for the first time."""
        now = time.monotonic() if now is None else now
        new = []
        for rank, beat in beats.items():
            h = self.ranks.get(rank)
            if h is None or (h.beat is not None and beat.seq == h.beat.seq):
                continue
            if h.beat is None:
                h.up_at = h.progressed_at = now
                h.progressed_wall = time.time()
                new.append(rank)
            elif beat.step != h.beat.step or beat.phase != h.beat.phase:
                h.progressed_at, h.progressed_wall = now, time.time()
            h.beat, h.heard_at, h.heard_wall = beat, now, time.time()
        return new

    def all_up(self) -> bool:
        return all(h.beat is not None for h in self.ranks.values())

    def stalled(self, now: float | None = None) -> list[int]:
        """Ranks that made no progress within their allowance (empty when hang detection is off)."""
        if self.hang_timeout is None:
            return []
        now = time.monotonic() if now is None else now
        return [h.rank for h in self.ranks.values()
                if h.progressed_at is not None and now - h.progressed_at > self.allowance(h.rank)[0]]

    def allowance(self, rank: int) -> tuple[float, str]:
        """How long ``rank`` may now go without progress, and what applied, in words for the hang
        message (``hang_timeout`` must be set)."""
        assert self.hang_timeout is not None
        h = self.ranks[rank]
        phase = h.beat.phase if h.beat is not None else None
        if h.step is not None and phase is None:
            return self.hang_timeout, "--hang_timeout"
        why = _PHASES.get(phase or "", "before its first step")
        if self.hang_timeout >= FIRST_STEP_ALLOWANCE_S:
            return self.hang_timeout, f"--hang_timeout, {why}"
        return FIRST_STEP_ALLOWANCE_S, (f"the allowance {why}, {FIRST_STEP_ALLOWANCE_S:g} s as for the first "
                                        f"step; --hang_timeout {self.hang_timeout:g} s is for steps")

    def silent(self, rank: int, now: float | None = None) -> bool:
        h = self.ranks[rank]
        now = time.monotonic() if now is None else now
        return h.heard_at is not None and now - h.heard_at > SILENT_AFTER_S

    def behind(self, stacks: Mapping[int, dict], now: float | None = None) -> list[int]:
        """The ranks to blame for a hang (see the module docstring); ``stacks`` as the agents
        answered them (rank -> ``{"stopped": bool, "stack": text or None}``)."""
        heard = [h for h in self.ranks.values() if h.beat is not None]
        if not heard:
            return []
        low = min(_order(h.step) for h in heard)
        suspects = [h.rank for h in heard if _order(h.step) == low]
        absent = self.absent_from_exchanges(stacks, now)
        filters = (
            lambda r: bool(stacks.get(r, {}).get("stopped")),
            lambda r: self.silent(r, now),
            lambda r: r in absent,
            lambda r: not self.waiting(r, stacks.get(r, {}), now),
        )
        for keep in filters:
            narrowed = [r for r in suspects if keep(r)]
            if narrowed and len(narrowed) < len(suspects):
                suspects = narrowed
        return sorted(suspects)

    def absent_from_exchanges(self, stacks: Mapping[int, dict], now: float | None = None) -> set[int]:
        """The ranks an MoE layer's all-to-all waits for: members of a waiting rank's expert group
        (``ExpertExchange``) that are not in that same exchange (elsewhere, or in another wait)."""
        waits = {r: self.wait_of(r, stacks.get(r, {}), now) for r in self.ranks}
        names = {r: w[0] for r, w in waits.items() if w is not None}
        return {r for name, exchange in _exchanges(names) for r in _not_in(name, exchange, names)}

    def waiting(self, rank: int, dump: Mapping, now: float | None = None) -> bool:
        """Whether ``rank`` waits for its peers (see the module docstring); ``dump``: its node's
        answer to the stack request (``{"stopped": bool, "stack": text or None}``)."""
        return self.wait_of(rank, dump, now) is not None or _in_collective(dump.get("stack"))

    def wait_of(self, rank: int, dump: Mapping, now: float | None = None) -> tuple[str, float] | None:
        """The marked wait ``rank``'s beats say it is in (name, seconds), when they are current."""
        beat = self.current_beat(rank, dump, now)
        if beat is None or beat.waiting is None:
            return None
        return beat.waiting, beat.waiting_s or 0.0

    def current_beat(self, rank: int, dump: Mapping, now: float | None = None) -> Beat | None:
        """``rank``'s last beat, unless it was found stopped or silent (then its last beat may
        predate where it stopped)."""
        beat = self.ranks[rank].beat
        return None if beat is None or dump.get("stopped") or self.silent(rank, now) else beat

    def summary(self, now: float | None = None) -> dict:
        """The job's progress now, for the status line and the periodic event.

        ``lagging``: the slowest rank is behind and has not moved for ``SILENT_AFTER_S`` (ranks
        in lockstep differ by a few steps between two beats: that is sampling, not lag)."""
        now = time.monotonic() if now is None else now
        heard = [h for h in self.ranks.values() if h.beat is not None]
        if not heard:
            return {"ranks_up": 0, "world": len(self.ranks)}
        slowest = min(heard, key=lambda h: (_order(h.step), h.rank))
        rates = [h.beat.samples_per_s for h in heard if h.beat.samples_per_s is not None]
        tokens = [h.beat.tokens_per_s for h in heard if h.beat.tokens_per_s is not None]
        mfus = [h.beat for h in heard if h.beat.mfu is not None]
        losses = [h.beat.loss for h in heard if h.beat.loss is not None]
        mems = [h.beat.memory for h in heard if h.beat.memory is not None]
        out: dict = {"ranks_up": len(heard), "world": len(self.ranks),
                     "step": max(_order(h.step) for h in heard), "slowest_rank": slowest.rank,
                     "slowest_step": slowest.step}
        out["lagging"] = bool(_order(slowest.step) < out["step"] and slowest.progressed_at is not None
                              and now - slowest.progressed_at > SILENT_AFTER_S)
        if rates:
            out["samples_per_s"] = round(max(rates), 3)  # the engine reports global samples
        if tokens:
            out["tokens_per_s"] = round(max(tokens), 1)  # ... and global tokens
        if mfus:  # each rank's own device: the job's MFU is their mean
            out["mfu"] = round(sum(b.mfu for b in mfus) / len(mfus), 4)
            out["mfu_from"] = mfus[0].mfu_from
        if losses:
            out["loss"] = losses[0]
        if mems:
            top = max(mems, key=lambda m: m.peak)
            out["memory"] = {"kind": top.kind, "used": max(m.used for m in mems), "peak": top.peak,
                             "total": top.total}
        if out["step"] < 0:
            out["step"] = None
        return out


def waited_for(name: str, waits: Mapping[int, str | None]) -> str:
    """``name`` (a wait) as the hang report says it: an MoE layer's all-to-all names the experts
    it waits on, those on the members of its group not in it (``waits``: each rank's wait)."""
    exchange = ExpertExchange.parse(name)
    if exchange is None:
        return name
    missing = _not_in(name, exchange, waits)
    return exchange.name(missing) if missing else name


def _exchanges(names: Mapping[int, str]) -> list[tuple[str, ExpertExchange]]:
    """The distinct MoE exchanges ranks wait in (name, exchange)."""
    parsed = {name: ExpertExchange.parse(name) for name in set(names.values())}
    return [(name, ex) for name, ex in parsed.items() if ex is not None]


def _not_in(name: str, exchange: ExpertExchange, waits: Mapping[int, str | None]) -> list[int]:
    """The members of ``exchange``'s group whose wait (``waits``) is not it (``name``)."""
    return [r for r in exchange.ranks if waits.get(r) != name]


_PHASES = {"checkpoint": "while saving or loading a checkpoint", "exit": "while the process exits"}


def _order(step: int | None) -> int:
    return -1 if step is None else step


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.+)$')
_SPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]*):(?P<line>\d+)\)$")
"""A frame as ``py-spy dump`` prints it (``    train (/path/train.py:12)``), for ranks without
faulthandler; its threads start with ``Thread <id> (idle|active...)``."""


def _threads(stack: str) -> list[list[re.Match]]:
    """A dump (faulthandler's or py-spy's) split into threads: each a list of frames, innermost first."""
    threads: list[list[re.Match]] = []
    for line in stack.splitlines():
        if "(most recent call first):" in line or line.startswith("Thread "):
            threads.append([])
        elif threads and (m := _FRAME.match(line) or _SPY_FRAME.match(line)):
            threads[-1].append(m)
    return [t for t in threads if t]


def _main_thread(stack: str | None) -> list[re.Match]:
    """The frames of the thread that runs the script: the one whose outermost frame is
    ``<module>`` (faulthandler does not name threads)."""
    threads = _threads(stack or "")
    for t in threads:
        if t[-1]["func"] == "<module>":
            return t
    return threads[-1] if threads else []


def top_frame(stack: str | None) -> str | None:
    """What the main thread was doing: its innermost frame, and the innermost frame of the
    script's own code when that is another one (``all_reduce (torch/...) from train.py:12 in
    main``); None without a stack."""
    frames = _main_thread(stack)
    if not frames:
        return None
    inner = frames[0]
    own = next((m for m in frames if not _LIBRARY.search(m["file"])), None)
    here = f"{own['file']}:{own['line']} in {own['func']}" if own else None
    if own is inner:
        return here
    lib = inner["file"] if inner["file"].startswith("<") else _LIBRARY.split(inner["file"])[-1].lstrip("/")
    return f"{inner['func']} ({lib}:{inner['line']})" + (f" from {here}" if here else "")


# the standard library's frozen modules (``<frozen os>`` since 3.11: os.environ, importlib) too
_LIBRARY = re.compile(r"(?:/lib/python3\.\d+)?/(?:site|dist)-packages/|/lib/python3\.\d+/|^<frozen ")


def _in_collective(stack: str | None) -> bool:
    """The main thread is in ``torch.distributed`` (a collective the script called itself)."""
    frames = _main_thread(stack)
    return bool(frames) and "torch/distributed/" in frames[0]["file"].replace("\\", "/")
