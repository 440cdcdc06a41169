"""The node agent: starts one node's workers, streams their output, stops them as a gang.

Used two ways: in-process by the local runner (no extra interpreter on the local path), and in
its own process on a remote host (``remote``, which reports through the ``wire`` lines).

Policy: the first worker that exits non-zero or by a signal is the node's failure; every other
worker then gets SIGTERM and, after ``NodeSpec.grace`` seconds, SIGKILL. The agent only starts,
watches and stops; deciding what a failure means for the job is the gang loop's
(``dslaunch.launcher.monitor``). Never imports torch.

Worker states (``WorkerState``)::

    RUNNING -> SUCCEEDED   exited 0
    RUNNING -> FAILED      exited non-zero or by a signal while nobody asked it to stop
    RUNNING -> STOPPED     exited after the agent signalled it (another failure, or a stop)
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import BinaryIO

from dslaunch.errors import LaunchError
from dslaunch.launcher.agent.channels import Channels
from dslaunch.launcher.agent.output import ExceptionWatch, Sink, pump
from dslaunch.launcher.agent.procs import (
    become_subreaper,
    child_setup,
    exit_code_of,
    kill_adopted,
    signal_group,
)
from dslaunch.launcher.agent.spare import Assignment, Spare, SpareLost, SparePool
from dslaunch.launcher.agent.watchdog import Watchdog
from dslaunch.launcher.monitor.failures import classify, oom_kills, root_cause
from dslaunch.launcher.spec import NodeResult, NodeSpec, WorkerSpec
from dslaunch.launcher.workerenv import monitor_env, process_env
from dslaunch.safe_write import FileId, create_replacing, open_dir, remove_own, write_new
from dslaunch.utils.beat import Beat

__all__ = ["Agent", "WorkerState"]

class WorkerState(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class Worker:
    """A started worker process and its bookkeeping."""

    spec: WorkerSpec
    proc: subprocess.Popen
    state: WorkerState = WorkerState.RUNNING
    exit_code: int | None = None
    exited_at: float | None = None
    """Wall-clock time the agent saw it exit."""
    threads: list[threading.Thread] = field(default_factory=list)
    watch: ExceptionWatch = field(default_factory=ExceptionWatch)


class Agent:
    """Runs one node's workers as a gang.

    Call ``start()`` from a thread that outlives the job (the main thread): workers get
    PDEATHSIG tied to that thread. Then ``wait()``/``poll()``; ``stop(sig)`` from any thread
    (not from a signal handler: record the signal there and call ``stop`` from the loop).

    Args:
        node: what to run.
        stdout_fd, stderr_fd: where prefixed worker output goes.
        on_change: called (from a helper thread) when the first worker fails (``failure``) and
            once the node has finished (``poll``).
        adopt_orphans: make this process a child subreaper and, when the job ends, SIGKILL every
            child process that is not a worker (daemons that left their worker's group). Only
            for a process that exists to run this job (the CLI, the agent command), never in a
            process with children of its own.
        spares: warm spare workers (``spare``) to hand workers to instead of spawning them; the
            pool belongs to the caller, which refills it (it outlives this run).
    """

    def __init__(self, node: NodeSpec, stdout_fd: int = 1, stderr_fd: int = 2,
                 on_change: Callable[[], None] | None = None, adopt_orphans: bool = False,
                 spares: SparePool | None = None) -> None:
        self.node = node
        self._spares = spares
        self._adopt = adopt_orphans
        self._out, self._err = Sink(stdout_fd), Sink(stderr_fd)
        self._on_change = on_change
        self._lock = threading.RLock()
        self._workers: list[Worker] = []
        self._spawning = True
        self._finishing = False
        self._failure: Worker | None = None
        self._stopped_by: int | None = None
        self._terminating = False
        self._done = threading.Event()
        self._result: NodeResult | None = None
        self._watchdog = Watchdog()
        self._logs: dict[int, Sink] = {}  # global rank -> its --enable_each_rank_log file
        self._pid_file: FileId | None = None
        self._timer: threading.Timer | None = None
        self._channels = Channels()  # heartbeats and stack dumps (the monitor's view of each rank)
        self._oom_before: int | None = None
        self._frozen = False  # stopped for a hang's stack dump: killed, never resumed

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start every worker. Raises LaunchError (after stopping the started ones) on failure."""
        shares = _core_shares(self.node)
        self._oom_before = oom_kills()
        self._prepare_files()
        if self._adopt:
            become_subreaper()
        self._watchdog.start(remove=[(self.node.pid_file, self._pid_file)] if self._pid_file else [])
        error = None
        try:
            for spec, cores in zip(self.node.workers, shares, strict=True):
                if self._terminating:  # an early worker already failed: start no more
                    break
                self._spawn(spec, cores)
        except OSError as err:
            error = err
            self.stop(signal.SIGKILL)
        with self._lock:
            self._spawning = False
        self._maybe_finish()
        if error is not None:
            self.wait()
            argv0 = error.filename or "worker"
            raise LaunchError(f"cannot start {argv0}: {error.strerror}", host=self.node.host) from error

    def _prepare_files(self) -> None:
        """Rank logs and pid file, before anything starts (an error leaves no pid file behind).

        Both may live in directories other users write to: see ``dslaunch.safe_write`` for why each is created
        new instead of opened with O_TRUNC.
        """
        node = self.node
        try:
            if node.log_dir:
                dir_fd = open_dir(node.log_dir, mode=0o700)
                try:
                    for w in node.workers:
                        name = f"rank{w.global_rank}.log"
                        try:
                            self._logs[w.global_rank] = Sink(create_replacing(dir_fd, name))
                        except OSError as err:
                            err.filename = os.path.join(node.log_dir, name)
                            raise
                finally:
                    os.close(dir_fd)
            if node.pid_file:
                self._pid_file = write_new(node.pid_file, f"{os.getpid()}\n".encode())
        except FileExistsError as err:  # only the pid file is never replaced
            self._close_logs()
            raise LaunchError(f"--save_pid: {err.filename} already exists (left by an earlier job, or put "
                              "there by someone else); dslaunch neither follows nor reuses it: check and "
                              "remove it", host=node.host) from None
        except OSError as err:
            self._close_logs()
            raise LaunchError(f"{err.filename}: {err.strerror}", host=node.host) from None

    def _close_logs(self) -> None:
        for log in self._logs.values():
            log.close()

    def _spawn(self, spec: WorkerSpec, cores: tuple[int, ...]) -> None:
        fds = self._channels.pipes(spec.global_rank)
        spare = self._spares.take(spec.argv) if self._spares is not None else None
        try:
            started = self._hand_to(spare, spec, cores, fds) if spare is not None else None
            if started is not None:
                proc, out, err = started
            else:
                proc = subprocess.Popen(
                    spec.argv, env=process_env(os.environ, self.node, spec, cores, monitor_env(*fds)),
                    cwd=self.node.cwd or None, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, preexec_fn=child_setup(cores), pass_fds=fds,
                )
                out, err = proc.stdout, proc.stderr
        finally:
            for fd in fds:  # the worker holds the write ends now: EOF comes when it (and its children) exit
                os.close(fd)
        self._watchdog.add(proc.pid)
        worker = Worker(spec, proc)
        log = self._logs.get(spec.global_rank)
        prefix = f"[rank{spec.global_rank}] ".encode()
        for pipe, sink, watch in ((out, self._out, None), (err, self._err, worker.watch)):
            t = threading.Thread(target=pump, args=(pipe, prefix, sink, log, watch), daemon=True)
            t.start()
            worker.threads.append(t)
        with self._lock:
            self._workers.append(worker)
        threading.Thread(target=self._monitor, args=(worker,), daemon=True,
                         name=f"wait-rank{spec.global_rank}").start()

    def _hand_to(self, spare: Spare, spec: WorkerSpec, cores: tuple[int, ...],
                 fds: tuple[int, int]) -> tuple[subprocess.Popen, BinaryIO, BinaryIO] | None:
        """Make ``spare`` the worker ``spec``: its process, and the read ends of its stdout and
        stderr; None when it did not take the worker (it is then dead and reaped, having run
        none of it, and the worker is spawned fresh: said on stderr, as it costs seconds)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            spare.assign(Assignment(spec.argv, process_env(os.environ, self.node, spec, cores), self.node.cwd or None,
                                    cores), (out_w, err_w, *fds))
        except SpareLost as lost:
            for fd in (out_r, err_r):
                os.close(fd)
            self.report(f"dslaunch: rank {spec.global_rank}: its warm spare (pid {spare.proc.pid}) did not "
                        f"take it ({lost}); started fresh")
            return None
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
        return spare.proc, open(out_r, "rb"), open(err_r, "rb")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every worker from outside: ``sig`` now, SIGKILL after the grace period.

        Safe to call repeatedly (not from a signal handler: it takes locks); the result then says
        ``stopped_by`` (unless a worker had already failed).
        """
        if self._stopped_by is None:
            self._stopped_by = sig
        self._terminate(sig)

    def _terminate(self, sig: int) -> None:
        if self._frozen:  # SIGTERM would need a SIGCONT: the frozen ranks would run on, maybe save
            sig = signal.SIGKILL
        with self._lock:
            first = not self._terminating
            self._terminating = True
            running = [w for w in self._workers if w.state is WorkerState.RUNNING]
        for w in running:
            signal_group(w.proc.pid, sig)
            if sig != signal.SIGKILL:  # a stopped worker (SIGSTOP) acts on it only once resumed
                signal_group(w.proc.pid, signal.SIGCONT)
        if first and sig != signal.SIGKILL:
            self._timer = threading.Timer(self.node.grace, self._kill_running)
            self._timer.daemon = True
            self._timer.start()

    def _kill_running(self) -> None:
        with self._lock:
            running = [w for w in self._workers if w.state is WorkerState.RUNNING]
        for w in running:
            signal_group(w.proc.pid, signal.SIGKILL)

    def _monitor(self, w: Worker) -> None:
        code, _ = exit_code_of(w.proc.wait())
        with self._lock:
            w.exit_code, w.exited_at = code, time.time()
            if self._terminating:
                w.state = WorkerState.STOPPED if code else WorkerState.SUCCEEDED
            elif code:
                w.state = WorkerState.FAILED
                self._failure = w
            else:
                w.state = WorkerState.SUCCEEDED
            failed_now = w.state is WorkerState.FAILED
        if failed_now:
            self._terminate(signal.SIGTERM)
            if self._on_change is not None:  # news before the node has finished stopping
                self._on_change()
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        with self._lock:
            if self._spawning or self._finishing:
                return
            if any(w.state is WorkerState.RUNNING for w in self._workers):
                return
            self._finishing = True
        self._finish()

    def _finish(self) -> None:
        """All workers exited: kill leftovers in their groups, drain output, record the result."""
        for w in self._workers:
            signal_group(w.proc.pid, signal.SIGKILL)  # grandchildren left behind in the group
        if self._adopt:  # daemons that left the group; never a spare, nor one being started
            with self._spares.held() if self._spares is not None else nullcontext(set()) as spares:
                kill_adopted(keep={self._watchdog.pid, *self.pids, *spares})
        deadline = time.monotonic() + 1.0  # a process outside the group may hold a pipe: do not hang
        for w in self._workers:
            for t in w.threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._timer is not None:
            self._timer.cancel()
        self._close_logs()
        self._channels.close()
        self._watchdog.release()
        if self.node.pid_file and self._pid_file:
            remove_own(self.node.pid_file, self._pid_file)
        self._result = self._make_result()
        self._done.set()
        if self._on_change is not None:
            self._on_change()

    def _make_result(self) -> NodeResult:
        node = self.node
        if (failure := self.failure) is not None:
            # A worker stopped after the first failure may have failed first (see root_cause).
            others = [self._failure_of(w) for w in self._workers if w is not self._failure and w.exit_code]
            return root_cause(failure, others)
        if self._stopped_by is not None and any(w.exit_code for w in self._workers):
            name = signal.Signals(self._stopped_by).name
            return NodeResult(node.node_rank, node.host, 128 + self._stopped_by, stopped_by=name)
        return NodeResult(node.node_rank, node.host, 0)

    # -- queries -------------------------------------------------------------------------------

    @property
    def failure(self) -> NodeResult | None:
        """The node's failure as soon as its first worker failed (the node may still be stopping
        the others); ``poll()`` then returns it once everything has exited, or the failure of a
        worker that raised before it where this one only lost its peer (``root_cause``)."""
        w = self._failure
        return None if w is None else self._failure_of(w)

    def _failure_of(self, w: Worker) -> NodeResult:
        code, sig_name = exit_code_of(w.proc.returncode)
        oom_now = oom_kills()
        oom_killed = oom_now is not None and self._oom_before is not None and oom_now > self._oom_before
        watch = w.watch
        # What it said it raised, the moment it raised: it may have been stopped (a peer it left
        # waiting exited first) before it printed its traceback.
        beat = self._channels.beats().get(w.spec.global_rank)
        said = beat if beat is not None and beat.raised else None
        exception = watch.exception or (said.raised if said else None)
        trace = watch.traceback or (said.raised_trace if said else None)
        cause = classify(code, sig_name, exception, trace, oom_killed)
        return NodeResult(self.node.node_rank, self.node.host, code, w.spec.global_rank, sig_name,
                          exception=exception, cause=cause, traceback=trace, failed_at=w.exited_at,
                          raised_at=said.raised_at if said else None)

    def poll(self) -> NodeResult | None:
        """The node's result once every worker has exited, else None."""
        return self._result

    def wait(self, timeout: float | None = None) -> NodeResult | None:
        self._done.wait(timeout)
        return self._result

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def report(self, line: str) -> None:
        """Write one line on the agent's stderr, whole (worker lines never split it)."""
        self._err.write(line.encode() + b"\n")

    def beats(self) -> dict[int, Beat]:
        """The latest heartbeat of every rank of this node that sent one."""
        return self._channels.beats()

    def request_checkpoint(self) -> list[int]:
        """Signal every running worker whose heartbeats say it takes checkpoint requests
        (``Beat.checkpoint_signal``; the default action would kill the others). Returns their ranks."""
        beats = self._channels.beats()
        with self._lock:
            running = [(w.spec.global_rank, w.proc.pid) for w in self._workers if w.state is WorkerState.RUNNING]
        asked = []
        for rank, pid in running:
            sig = beats[rank].checkpoint_signal if rank in beats else None
            if sig:
                try:
                    os.kill(pid, sig)
                    asked.append(rank)
                except ProcessLookupError:
                    pass
        return asked

    def dump_stacks(self, wait: float = 2.0) -> dict[int, dict]:
        """Every running worker's Python stacks (see ``Channels.dump_stacks``). Blocks up to
        ``wait`` per batch. The workers are left frozen: only a hang asks, and a hung job ends;
        the stop that follows kills them at once (``_terminate``), never resumes them."""
        with self._lock:
            self._frozen = True
            running = {w.spec.global_rank: w.proc.pid for w in self._workers if w.state is WorkerState.RUNNING}
        return self._channels.dump_stacks(running, wait)


def _core_shares(node: NodeSpec) -> list[tuple[int, ...]]:
    """Each worker's cores under ``bind_cores`` (contiguous, equal shares), else no pinning.

    Raises:
        LaunchError: fewer cores than workers.
    """
    n = len(node.workers)
    if not node.bind_cores:
        return [()] * n
    cores = sorted(node.core_list or os.sched_getaffinity(0))
    if len(cores) < n:
        raise LaunchError(f"--bind_cores_to_rank: {len(cores)} cores for {n} workers", host=node.host)
    per = len(cores) // n
    return [tuple(cores[i * per:(i + 1) * per]) for i in range(n)]
