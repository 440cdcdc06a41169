"""The monitor of one job run: heartbeats in, events, status, hang diagnosis and error files out.

``JobMonitor`` is what the gang loop consults on each turn (``observe``, ``stalled``), asks to
diagnose a hang (``diagnose_hang``: stacks from every node, the ranks behind, a ``hang``
failure), and hands the job's end to (``finish``: the failure event with the root cause first,
one error file per failed rank, the end event). It only decides and records; the handles
(mechanism) fetch beats and stacks.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from dslaunch.errors import name_ranks
from dslaunch.launcher.monitor.events import EventLog
from dslaunch.launcher.monitor.failures import OOM_REMEDIES, classify, is_peer_loss
from dslaunch.launcher.monitor.health import Health, top_frame, waited_for
from dslaunch.launcher.monitor.status import StatusLine, process_start_ticks
from dslaunch.launcher.spec import HANG_EXIT_CODE, JobSpec, NodeResult
from dslaunch.utils.beat import Beat

if TYPE_CHECKING:
    from dslaunch.launcher.monitor.gang import GangResult, NodeHandle

__all__ = ["JobMonitor", "SUMMARY_EVERY_S", "STACKS_WAIT_S"]

SUMMARY_EVERY_S = 30.0
STACKS_WAIT_S = 5.0
"""How long a hang diagnosis waits for the nodes' stack dumps: an agent takes them in two
batches of up to 2 s each (the ranks that were running, then those that were stopped)."""


class JobMonitor:
    """Watches one run of a job. Not thread-safe: the gang loop owns it."""

    def __init__(self, job: JobSpec, events: EventLog, status: StatusLine | None = None,
                 owns_log: bool = True) -> None:
        self.job = job
        self.events = events
        self._owns_log = owns_log  # else the log spans several runs (restarts): its owner ends it
        self.status = status if status is not None else StatusLine()
        self.health = Health([(w.global_rank, i, n.host) for i, n in enumerate(job.nodes) for w in n.workers],
                             job.monitor.hang_timeout)
        self._start = time.monotonic()
        self._up_said = False
        self._rss_said = False
        self._summary_at = self._start
        self._hang: tuple[NodeResult, dict, float] | None = None
        self._raised: dict[int, str | None] = {}  # rank -> its error file, written when it raised
        self._memory_held: dict[str, dict] = {}  # host -> its memory checkpoints: newest step, bytes
        self._restored_said = False

    def start(self, argv: list[str] | None = None) -> None:
        self.events.emit("start", job_id=os.path.basename(self.events.directory or ""),
                         hosts=list(self.job.hosts), world_size=self.job.world_size,
                         hang_timeout=self.job.monitor.hang_timeout, pid=os.getpid(),
                         host=socket.gethostname(), pid_start_ticks=process_start_ticks(os.getpid()),
                         argv=list(sys.argv if argv is None else argv))

    # -- each turn of the gang loop ------------------------------------------------------------

    def observe(self, handles: list[NodeHandle]) -> None:
        now = time.monotonic()
        beats = {}
        for h in handles:
            beats.update(h.beats())
        self.health.update(beats, now)
        for rank, beat in beats.items():
            if beat.raised and rank not in self._raised and not is_peer_loss(beat.raised):
                self._raised[rank] = self._raised_file(rank, beat)
            if beat.memory_checkpoint:
                self._memory_checkpoint(beat.memory_checkpoint)
        if not self._up_said and self.health.all_up():
            self._up_said = True
            self.events.emit("ranks_up", after_s=round(now - self._start, 3))
        summary = self._summary()
        mem = summary.get("memory")
        if mem and mem["kind"] == "rss" and not self._rss_said:
            self._rss_said = True  # said once per job, here and on the status line ("RSS")
            self.events.emit("note", text="memory: no GPU memory from NVML (no CUDA in use, or no driver); "
                                          "reporting each rank's process RSS")
        if summary.get("ranks_up") and now - self._summary_at >= SUMMARY_EVERY_S:
            self._summary_at = now
            self.events.emit("summary", **summary)
        self.status.show(summary, now)

    def _summary(self) -> dict:
        """The health's summary, with each host's memory checkpoints (newest step, bytes held)."""
        summary = self.health.summary()
        if self._memory_held:
            summary["memory_checkpoint"] = {h: dict(v) for h, v in self._memory_held.items()}
        return summary

    def _memory_checkpoint(self, info: dict) -> None:
        """A rank's report on the in-memory checkpoints: its host's store, or (once) where the
        restarted run's state came from, with the steps lost: the furthest step the job had
        reached (its last progress summary, failure or run end before this run) minus the restored one."""
        if isinstance(info.get("host"), str) and isinstance(info.get("bytes"), int):
            if info["host"] not in self._memory_held and isinstance(info.get("store"), str):
                self.events.emit("memory_store", host=info["host"], path=info["store"])  # freed at the end
            self._memory_held[info["host"]] = {"step": info.get("step"), "bytes": info["bytes"]}
        restored = info.get("restored")
        if isinstance(restored, dict) and not self._restored_said and isinstance(restored.get("step"), int):
            self._restored_said = True
            log = self.events.events
            runs = [i for i, e in enumerate(log) if e.get("kind") == "resume"]  # this run's start
            before = [e.get("step") for e in log[:runs[-1] if runs else len(log)]
                      if e.get("kind") in ("summary", "failure", "run_end")]
            reached = max((s for s in before if isinstance(s, int)), default=None)
            # heartbeats are sampled: the furthest step heard may trail the restored one (never < 0)
            lost = max(0, reached - restored["step"]) if reached is not None else None
            self.events.emit("restored", source=restored.get("source"), step=restored["step"],
                             storage_step=restored.get("storage_step"), steps_lost=lost)

    def stalled(self) -> list[int]:
        return self.health.stalled()

    # -- a hang ----------------------------------------------------------------------------------

    def diagnose_hang(self, handles: list[NodeHandle], stalled: list[int]) -> tuple[NodeResult, set[int]]:
        """Dump every rank's stacks, name the ranks behind, record it all.

        Returns the hang failure (the first rank behind) and the indices of the nodes holding the
        ranks behind (stopped at once, without a grace period).
        """
        detected = time.time()
        # Silence is judged as of now: the dumps below freeze the ranks (up to STACKS_WAIT_S), and
        # a rank whose last beat came a moment earlier than its peer's would look silent after.
        judged_at = time.monotonic()
        for h in handles:
            h.request_stacks()
        stacks: dict[int, dict] = {}
        deadline = time.monotonic() + STACKS_WAIT_S
        waiting = set(range(len(handles)))
        while waiting and time.monotonic() < deadline:
            for i in list(waiting):
                got = handles[i].stacks()
                if got is not None:
                    stacks.update(got)
                    waiting.discard(i)
            time.sleep(0.05)
        behind = self.health.behind(stacks, judged_at) or sorted(stalled)
        # The step each rank was in: a rank stopped right after a step had not sent it yet (beats
        # go out twice a second); resumed for its dump while its peers were frozen, it did.
        latest: dict[int, Beat] = {}
        for h in handles:
            latest.update(h.beats())
        steps = {r: latest[r].step if r in latest else h.step for r, h in self.health.ranks.items()}
        ranks = {}
        for rank, h in sorted(self.health.ranks.items()):
            info = stacks.get(rank, {})
            text = info.get("stack")
            path = self.events.write_file(f"stacks-rank{rank}.txt", text) if text else None
            wait, beat = self.health.wait_of(rank, info, judged_at), self.health.current_beat(rank, info, judged_at)
            ranks[str(rank)] = {"host": h.host, "step": steps[rank], "stopped": bool(info.get("stopped")),
                                "silent": self.health.silent(rank, judged_at), "top_frame": top_frame(text), "file": path,
                                "via": info.get("via"), "waiting": self.health.waiting(rank, info, judged_at),
                                "waiting_in": wait[0] if wait else None, "waiting_s": wait[1] if wait else None,
                                "activity": beat.activity if beat is not None else None}
        if missing := {r: stacks.get(r, {}).get("why") or "no answer from its node"
                       for r in sorted(self.health.ranks) if not stacks.get(r, {}).get("stack")}:
            why = "; ".join(f"rank {r}: {w}" for r, w in missing.items())
            self.events.emit("note", text=f"no stack could be taken for {len(missing)} rank(s): {why}"[:2000])
        self.events.emit("stacks", behind=behind, stalled=sorted(stalled), ranks=ranks,
                         hang_timeout=self.health.hang_timeout)
        first = self.health.ranks[behind[0]]
        # The allowance that ran out: the blamed rank's may be longer (no step of it heard yet)
        allowed, why = self.health.allowance(first.rank if first.rank in stalled else min(stalled))
        failure = NodeResult(self.job.nodes[first.node].node_rank, first.host, HANG_EXIT_CODE, rank=first.rank,
                             cause="hang", step=steps[first.rank], failed_at=first.progressed_wall,
                             message=f"no progress for {allowed:g} s: {why}")
        self._hang = (failure, ranks, detected)
        return failure, {self.health.ranks[r].node for r in behind}

    # -- the end ---------------------------------------------------------------------------------

    def finish(self, result: GangResult, results: list[NodeResult], detected_at: float | None) -> str | None:
        """Record how the job ended; return what the user should read beyond the failure's own
        line (the remedy, where stacks and error files are), or None."""
        self.status.clear()
        notes: list[str] = []
        if self.health.summary().get("ranks_up"):
            self.events.emit("summary", **self._summary())  # the last known progress
        failure = result.failure
        if failure is not None:
            failure = self._complete(failure)
            others = [self._complete(r) for r in results
                      if r.rank is not None and r.exit_code and r.cause and r.rank != failure.rank]
            files = [p for p in (self._error_file(f, root=f is failure) for f in [failure, *others]) if p]
            told = {failure.rank, *(o.rank for o in others)}
            files += [p for r, p in self._raised.items() if p and r not in told]  # raised, then stopped
            remedy = OOM_REMEDIES if failure.cause == "oom" else None
            fault_t = failure.failed_at or self._last_heard(failure)
            self.events.emit("failure", message=failure.describe(), rank=failure.rank, host=failure.host,
                             cause=failure.cause, exit_code=failure.exit_code, signal=failure.signal_name,
                             exception=failure.exception, step=failure.step, fault_t=fault_t,
                             detected_t=detected_at, remedy=remedy, error_files=files,
                             others=[o.describe() for o in others])
            if remedy:
                notes.append(remedy)
            if failure.cause == "hang":
                notes.append(self._hang_note())
            if self.events.directory:
                notes.append(f"details: dslaunch status {self.events.directory}")
        self.end(result.exit_code, stopped_by=result.stopped_by)
        return "; ".join(notes) or None

    def end(self, exit_code: int, **fields: object) -> None:
        """The run's last event: ``end`` when this monitor owns the log (then closed), else
        ``run_end`` (the log spans several runs: its owner writes the job's ``end``)."""
        # step: the furthest any rank reported in this run (a restart's steps lost are counted from it)
        self.events.emit("end" if self._owns_log else "run_end", exit_code=exit_code, **fields,
                         step=self.health.summary().get("step"), duration_s=round(time.monotonic() - self._start, 3))
        if self._owns_log:
            self.events.close()

    def complete(self, failure: NodeResult) -> NodeResult:
        """``failure`` with what the monitor knows added: the rank's last step, a cause."""
        return self._complete(failure)

    def _complete(self, r: NodeResult) -> NodeResult:
        step = r.step
        if step is None and r.rank in self.health.ranks:
            step = self.health.ranks[r.rank].step
        cause = r.cause or classify(r.exit_code, r.signal_name, r.exception, r.traceback)
        return replace(r, step=step, cause=cause)

    def _last_heard(self, r: NodeResult) -> float | None:
        """For a lost host: when any of its ranks was last heard of (wall clock)."""
        times = [h.heard_wall for h in self.health.ranks.values() if h.host == r.host and h.heard_wall]
        return max(times) if times else None

    def _error_file(self, r: NodeResult, root: bool) -> str | None:
        if r.rank is None:
            return None
        record = {"rank": r.rank, "host": r.host, "root_cause": root, "cause": r.cause,
                  "exit_code": r.exit_code, "signal": r.signal_name, "step": r.step,
                  "exception": r.exception, "traceback": r.traceback, "failed_at": r.failed_at,
                  "raised_at": r.raised_at, "message": r.describe()}
        if r.cause == "oom":
            record["remedy"] = OOM_REMEDIES
        if r.cause == "hang":
            record["stacks"] = self._hang[1].get(str(r.rank)) if self._hang else None
        return self.events.write_file(f"error-rank{r.rank}.json", json.dumps(record, indent=2) + "\n")

    def _raised_file(self, rank: int, beat: Beat) -> str | None:
        """``rank``'s error file the moment it said it raised, while the job still runs (its
        peers fail next, and it may be stopped before it prints a traceback); ``finish``
        rewrites it with how the rank ended."""
        host = self.health.ranks[rank].host if rank in self.health.ranks else None
        record = {"rank": rank, "host": host, "root_cause": None, "cause": classify(1, None, beat.raised,
                                                                                    beat.raised_trace),
                  "exit_code": None, "signal": None, "step": beat.step, "exception": beat.raised,
                  "traceback": beat.raised_trace, "failed_at": None, "raised_at": beat.raised_at,
                  "message": f"rank {rank} on {host} raised {beat.raised} (the job was still running)"}
        return self.events.write_file(f"error-rank{rank}.json", json.dumps(record, indent=2) + "\n")

    def _hang_note(self) -> str:
        """What the blamed rank was doing, who waited for it, where the stacks are."""
        assert self._hang is not None
        failure, ranks, _ = self._hang
        info = ranks.get(str(failure.rank), {})
        parts = []
        if info.get("stopped"):
            parts.append("it was stopped: SIGSTOP")
        elif info.get("silent"):
            parts.append("silent: no heartbeat")
        elif info.get("activity"):
            parts.append(f"it was {info['activity']}")
        if info.get("waiting_in"):  # in another collective than its peers (an MoE exchange's)
            parts.append(f"it was waiting in {info['waiting_in']}")
        if info.get("top_frame"):
            parts.append(f"it was in {info['top_frame']}")
        waits: dict[str, list[int]] = {}
        waiting_in = {int(rank): r.get("waiting_in") for rank, r in ranks.items()}
        for rank, r in ranks.items():
            if r.get("waiting_in") and int(rank) != failure.rank:
                # what the engine said it was doing, e.g. which pipeline receive
                doing = f" ({r['activity']})" if r.get("activity") else ""
                waits.setdefault(f"{waited_for(r['waiting_in'], waiting_in)}{doing}", []).append(int(rank))
        parts += [f"{name_ranks(rs)} waited for it in {name}" for name, rs in list(waits.items())[:3]]
        if self.events.directory:
            parts.append(f"every rank's stack is in {self.events.directory}")
        return "; ".join(parts)
