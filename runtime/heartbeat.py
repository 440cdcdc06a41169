"""Worker side of the monitor: progress beats to the node agent and stack dumps on request.

A worker started by dslaunch finds two pipes in its environment (``dslaunch.utils.beat``). This
module reports on them without the script doing anything beyond training:

- the engine calls ``beat`` at every optimizer step; custom loops and scripts that never call
  ``initialize`` call ``dslaunch.heartbeat(step, loss=None, samples=None)`` once per step;
- ``start()`` (from ``init_distributed``/``initialize``, or the first beat) registers
  ``faulthandler`` on ``STACK_SIGNAL`` (every thread's Python stack into the stack pipe, also while
  the main thread is stuck in C, e.g. a collective) and sends the first beat: the rank is up;
- a daemon thread sends what changed every ``TICK_S``, and a beat every ``LIVENESS_S`` anyway, so
  the monitor tells a rank that is alive but waiting from one that is frozen or stopped; at exit
  (also by an exception) the last unsent step goes out;
- the pipeline engine says which instruction it runs (``activity``): the hang report then tells
  what a waiting stage waits for (which micro batch, from which stage);
- the moment the rank raises (the pipeline engine when a stage's batch fails, an uncaught
  exception before the interpreter tears down), ``raised`` sends what and when at once: the
  launcher blames the first rank that raised, whichever process exits first;
- the engine's collectives and waits on its peers run inside ``waiting(name)``: the beat says "in
  <name> for <s> seconds", so on a hang the monitor blames the rank that is *not* waiting (its
  stack alone cannot tell: a ``work.wait()`` is a frame of dslaunch's, not of torch.distributed).
  Only the main thread's waits count: a background checkpoint writer waiting for its peers says
  nothing about whether training is stuck.

Cost: a ``waiting`` mark is a small object, a thread check, a few attribute writes and a clock read
(~0.6 us measured on a loaded 2-core VM, against tens of us for the collective it marks). Per
step, ``beat`` stores a few fields and, when a running total (samples, tokens, FLOPs) moved,
reads the monotonic clock once (vDSO: no system call); the rates (samples/s, tokens/s, and MFU
against the peak the engine gave ``set_peak``) are worked out by the sender; the loss is read
(``float()``, a device sync on GPU) only when the thread is about to send, i.e. at most twice a
second. Everything is a no-op outside dslaunch (no pipes in the environment).

Memory is measured here, in the worker (the controller never imports psutil): GPU used/total/peak
from NVML (``pynvml``) when this process has initialised CUDA, else the process RSS (psutil) and
its peak (``getrusage``).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import os
import resource
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from typing import Any

from dslaunch.runtime import preempt
from dslaunch.utils.beat import HEARTBEAT_FD_ENV, STACK_FD_ENV, STACK_SIGNAL, Beat, Memory

__all__ = ["Heartbeat", "heartbeat", "reporter", "start", "waiting", "wait_all", "TICK_S", "LIVENESS_S"]

TICK_S = 0.5
"""The sender thread's period: progress reaches the agent within this (and costs <= 2 writes/s)."""
LIVENESS_S = 2.0
"""A beat at least this often while the process runs, progress or not."""
RAISED_CHARS = 300
"""The exception line a beat carries (as ``ExceptionWatch`` keeps from stderr)."""
RAISED_TRACE_CHARS = 2000
"""The end of the traceback a beat carries: the beat stays one atomic pipe write."""


class Heartbeat:
    """One rank's reporter: the per-step ``beat`` stores, a daemon thread sends.

    Args:
        fd: write end of the heartbeat pipe (made non-blocking: a busy agent drops beats, it
            never stalls training).
        rank: the global rank.
        stack_fd: write end of the stack pipe, or None (no stack dumps).
    """

    def __init__(self, fd: int, rank: int, stack_fd: int | None = None) -> None:
        self._fd: int | None = fd
        self._rank = rank
        self._stack_fd = stack_fd
        self._step: int | None = None
        self._phase: str | None = None
        self._activity: object = None  # str() of it in the sender thread: the training thread never formats
        self._wait: tuple[str, float] | None = None  # (name, monotonic time it began): one write, atomic
        self._main = threading.main_thread().ident
        self._loss: float | None = None
        self._want_loss = True
        self._dirty = False
        self._seq = 0
        self._memory = _MemorySampler()
        self._samples, self._tokens, self._flops = _Rate(), _Rate(), _Rate()
        self._peak: float | None = None  # the device's peak FLOP/s (set_peak), for MFU
        self._mfu_from: str | None = None
        self._stack_signal: int | None = None
        self._raised: tuple[str, float, str] | None = None  # (exception line, time.time(), traceback tail)
        self._memory_checkpoint: dict[str, Any] | None = None
        self._lock = threading.Lock()  # the thread and start() may both send
        self._started = False
        self.writes = 0
        """Lines written so far (the rate-limit test reads it)."""

    def start(self) -> None:
        """Register the stack dump, send the 'up' beat and start the sender thread. Idempotent."""
        with self._lock:
            if self._started:
                return
            self._started = True
        if self._stack_fd is not None:
            try:
                faulthandler.register(STACK_SIGNAL, file=self._stack_fd, all_threads=True, chain=False)
                self._stack_signal = int(STACK_SIGNAL)
            except (OSError, ValueError, RuntimeError):  # e.g. a closed fd
                self._stack_signal = None
        self._send()
        _report_uncaught(self)
        # A script that reports through dslaunch.heartbeat() but made its process group itself
        # (no init_distributed) must still free it before Python finalizes, or gloo's threads abort
        # the process (SIGABRT, exit 134 instead of its own code): see runtime/shutdown.py.
        # Imported here: shutdown imports this module. Registered first, so it runs after _flush.
        # Before the sender thread starts: it reads sys.modules["torch"], which this import may
        # leave half-initialised while it runs (the thread then died of an AttributeError).
        from dslaunch.runtime.shutdown import register_clean_exit

        register_clean_exit()
        atexit.register(self._flush)  # a rank that dies of an exception still tells its last step
        threading.Thread(target=self._run, name="dslaunch-heartbeat", daemon=True).start()

    def _flush(self) -> None:
        if self._dirty:
            self._send()

    def beat(self, step: int, loss: Any = None, samples: int | None = None, tokens: int | None = None,
             flops: float | None = None) -> None:
        """Record that ``step`` finished, with the running totals of samples, tokens and model FLOPs
        (any may be None: not counted). Cheap: no system call (see the module docstring)."""
        if not self._started:
            self.start()
        self._step = step
        now = None
        for rate, count in ((self._samples, samples), (self._tokens, tokens), (self._flops, flops)):
            if count is not None and count != rate.count:
                # Step times, not send times: a job whose steps all fall within one tick has a rate too.
                now = now or time.monotonic()
                rate.mark(now, count)
        if loss is not None and self._want_loss:
            self._want_loss = False
            self._loss = _as_float(loss)
        self._dirty = True

    def set_peak(self, peak: float | None, mfu_from: str | None) -> None:
        """MFU is the FLOPs rate over ``peak`` (the device's FLOP/s), counted as ``mfu_from`` says."""
        self._peak, self._mfu_from = peak, mfu_from

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a stretch that is not a training step (e.g. ``checkpoint``): while it lasts, the
        monitor allows it as long as a first step, not only ``hang_timeout``."""
        self._phase, self._dirty = name, True
        try:
            yield
        finally:
            self._phase, self._dirty = None, True

    def set_activity(self, what: object) -> None:
        """Say what the engine is doing now: ``str(what)`` (formatted when a beat goes out, so an
        immutable object costs one attribute write per call); None: nothing."""
        self._activity, self._dirty = what, True

    def waiting(self, name: str) -> contextlib.AbstractContextManager:
        """Mark the stretch where this rank waits for its peers in ``name`` (a collective, or a
        barrier-like wait). Nests: the innermost mark is reported, the outer one comes back after."""
        return _Waiting(self, name)

    def set_memory_checkpoint(self, info: dict[str, Any]) -> None:
        """Report the in-memory checkpoints (``Beat.memory_checkpoint``); the keys given replace
        the ones said before."""
        self._memory_checkpoint, self._dirty = {**(self._memory_checkpoint or {}), **info}, True

    def exiting(self) -> None:
        """The script is done: say so now (tearing down a process may outlast ``hang_timeout``)."""
        if self._started:
            self._phase = "exit"
            self._send()

    def raised(self, err: BaseException) -> None:
        """Tell the agent now that this rank raised ``err`` (once: the first one is the cause).

        Called where the exception is first known for sure (the pipeline engine's failed batch,
        the uncaught-exception hook), before anything that could make a peer fail first: the
        stops sent to the other stages, the teardown that closes the process group."""
        if self._raised is not None or not self._started:
            return
        line = "".join(traceback.format_exception_only(type(err), err)).strip().splitlines() or [type(err).__name__]
        trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        self._raised = (_one_line(line[-1], RAISED_CHARS), time.time(), trace[-RAISED_TRACE_CHARS:])
        self._send()

    def _run(self) -> None:
        last = time.monotonic()
        while self._fd is not None:
            time.sleep(TICK_S)
            now = time.monotonic()
            if self._dirty or now - last >= LIVENESS_S:
                self._send()
                last = now

    def _send(self) -> None:
        with self._lock:
            self._dirty = False
            self._want_loss = True
            self._seq += 1
            wait, activity = self._wait, self._activity
            flops_per_s = self._flops.update()
            mfu = round(flops_per_s / self._peak, 4) if flops_per_s is not None and self._peak else None
            beat = Beat(self._rank, self._seq, self._step, self._samples.update(), self._loss,
                        self._memory.sample(), self._stack_signal, os.getpid(), preempt.armed_signal(),
                        self._phase, wait[0] if wait else None,
                        round(time.monotonic() - wait[1], 3) if wait else None,
                        _rounded(self._tokens.update()), mfu, self._mfu_from if mfu is not None else None,
                        str(activity)[:300] if activity is not None else None, *(self._raised or (None,) * 3),
                        memory_checkpoint=self._memory_checkpoint)
            self._write(beat.to_line())

    def _write(self, line: bytes) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, line)
            self.writes += 1
        except BlockingIOError:
            pass  # the agent is behind: drop this beat, the next one carries the same news
        except OSError:  # the agent is gone (EPIPE) or the fd was closed by the script
            self._fd = None


def _one_line(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _report_uncaught(hb: Heartbeat) -> None:
    """Wrap ``sys.excepthook`` so an uncaught exception reaches the agent before the traceback is
    printed and the process tears down (its peers' collectives fail once it is gone, and one of
    them may exit first). dslaunch's one-line hook goes inside, and the wrapper counts as it
    (``install_excepthook`` then leaves it in place)."""
    from dslaunch.errors import install_excepthook

    install_excepthook()
    inner = sys.excepthook

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        if isinstance(exc, Exception):  # Ctrl-C reaches every rank: nobody to blame
            with contextlib.suppress(Exception):  # reporting never hides the exception itself
                hb.raised(exc)
        inner(exc_type, exc, tb)

    hook._dslaunch = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class _Rate:
    """A running total's rate per second between the steps that moved it since the previous read
    (or, the first time, since the first step reported). ``mark`` runs on the training thread,
    ``update`` on the sender's."""

    __slots__ = ("count", "_moved", "_from", "_per_s")

    def __init__(self) -> None:
        self.count: float = -1  # the last total reported (-1: none yet)
        self._moved: tuple[float, float] | None = None  # (time, total) at the step that last moved it
        self._from: tuple[float, float] | None = None  # ... and at the one the rate runs from
        self._per_s: float | None = None

    def mark(self, now: float, count: float) -> None:
        went_back = count < self.count  # a checkpoint loaded mid-process
        self.count = count
        self._moved = (now, count)
        if self._from is None or went_back:
            self._from = self._moved

    def update(self) -> float | None:
        moved, start = self._moved, self._from
        if moved is None or start is None:
            return self._per_s
        if moved[1] < start[1]:  # mark() re-anchored while this thread was between reads: again
            self._from = moved
        elif moved[1] != start[1] and moved[0] > start[0]:  # else nothing new: the last rate stands
            self._per_s = (moved[1] - start[1]) / (moved[0] - start[0])
            self._from = moved
        return self._per_s


def _rounded(rate: float | None) -> float | None:
    return round(rate, 1) if rate is not None else None  # a short beat: tenths of a token are noise


_OTHER_THREAD = ("", 0.0)  # _Waiting._prev of a mark made off the main thread: not recorded


class _Waiting:
    """The context manager of ``Heartbeat.waiting``: a class, not a generator, to stay cheap."""

    __slots__ = ("_hb", "_name", "_prev")

    def __init__(self, hb: Heartbeat, name: str) -> None:
        self._hb, self._name = hb, name

    def __enter__(self) -> None:
        hb = self._hb
        if threading.get_ident() != hb._main:
            self._prev = _OTHER_THREAD
            return
        self._prev = hb._wait
        hb._wait, hb._dirty = (self._name, time.monotonic()), True

    def __exit__(self, *exc: object) -> None:
        if self._prev is not _OTHER_THREAD:
            self._hb._wait, self._hb._dirty = self._prev, True


def _as_float(loss: Any) -> float | None:
    try:
        value = float(loss.detach()) if hasattr(loss, "detach") else float(loss)
    except (TypeError, ValueError, RuntimeError):  # a non-scalar tensor, say
        return None
    return value if value == value and abs(value) != float("inf") else None  # JSON has no nan/inf


class _MemorySampler:
    """GPU memory from NVML for a process that uses CUDA, else RSS; errors fall back to RSS."""

    def __init__(self) -> None:
        self._gpu_ok = True
        self._handle: Any = None
        self._peak = 0

    def sample(self) -> Memory | None:
        if self._gpu_ok and _cuda_in_use():
            try:
                return self._gpu()
            except Exception:  # NVML missing or failing: say RSS from now on (pynvml raises its own types)
                self._gpu_ok = False
        return _rss()

    def _gpu(self) -> Memory:
        import pynvml

        if self._handle is None:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_gpu())
        info = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
                if p.pid == os.getpid() and p.usedGpuMemory]
        used = int(mine[0]) if mine else int(info.used)  # another pid namespace: the whole GPU's
        self._peak = max(self._peak, used)
        return Memory("gpu", used, self._peak, int(info.total))


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")  # never import torch here: a torch-free script stays so
    return bool(torch is not None and torch.cuda.is_initialized())


def _physical_gpu() -> int:
    """NVML's index of this process's current CUDA device (CUDA_VISIBLE_DEVICES renumbers)."""
    logical = sys.modules["torch"].cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    return int(visible[logical]) if logical < len(visible) and visible[logical].strip().isdigit() else logical


def _rss() -> Memory | None:
    try:
        import psutil

        used = psutil.Process().memory_info().rss
    except (ImportError, OSError):
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return Memory("rss", int(used), int(max(peak, used)))


@functools.cache
def reporter() -> Heartbeat | None:
    """This process's reporter, or None when dslaunch did not start it (no pipe in the env).

    One per process because the pipe is one per process; cached so the per-step lookup is a
    dictionary hit.
    """
    fd = _env_fd(HEARTBEAT_FD_ENV)
    if fd is None:
        return None
    try:
        os.set_blocking(fd, False)
        os.set_inheritable(fd, False)  # programs the script execs do not speak for this rank
    except OSError:
        return None
    stack_fd = _env_fd(STACK_FD_ENV)
    if stack_fd is not None:
        try:
            os.set_inheritable(stack_fd, False)
        except OSError:
            stack_fd = None
    return Heartbeat(fd, int(os.environ.get("RANK", "0")), stack_fd)


def _env_fd(name: str) -> int | None:
    raw = os.environ.get(name, "")
    return int(raw) if raw.isdigit() else None


def start() -> None:
    """Announce this rank and arm its stack dump (no-op outside dslaunch). Idempotent."""
    r = reporter()
    if r is not None:
        r.start()


def waiting(name: str) -> contextlib.AbstractContextManager:
    """``with waiting("all_reduce of gradients"): work.wait()``: while inside, this rank's beats say it
    waits for its peers in ``name`` (see the module docstring); a no-op outside dslaunch.

    For the engine's collectives and waits (and ``dslaunch.comm``'s): a rank stuck in the
    script's own code is then told apart from the peers that wait for it.
    """
    r = reporter()
    return _NOT_WATCHED if r is None else _Waiting(r, name)


_NOT_WATCHED = contextlib.nullcontext()  # reusable: it holds no state


def wait_all(works: Iterable[Any], name: str) -> None:
    """Wait for each of ``works`` (``torch.distributed`` async handles; None: nothing to wait
    for) inside ``waiting(name)``."""
    with waiting(name):
        for w in works:
            if w is not None:
                w.wait()


def heartbeat(step: int, loss: Any = None, samples: int | None = None) -> None:
    """Report that training step ``step`` finished on this rank (``dslaunch.heartbeat``).

    For custom training loops and scripts that never call ``dslaunch.initialize`` (the engine
    reports by itself). Call it once per step on every rank; it is cheap (no system call) and a
    no-op when the script was not started by dslaunch.

    Args:
        step: the number of the step that just finished (increasing).
        loss: the step's loss (a float or a scalar tensor); read at most twice a second.
        samples: samples processed so far on this rank, for samples/s.
    """
    r = reporter()
    if r is not None:
        r.beat(step, loss, samples)
