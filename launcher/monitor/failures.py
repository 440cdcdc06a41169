"""What kind of failure a dead rank is, and what to tell the user about it.

``classify`` names the cause the restart policy reads (``NodeResult.cause``) from the facts of
a worker's death: its exit code or signal, the exception it printed, and whether the kernel's OOM
killer struck. The agent applies it (only it has the facts); ``hang`` and ``host_lost`` are
decided by the controller (``health``, ``gang``), ``start`` by the job loop (a restarted run that
could not start). ``OOM_REMEDIES`` is the advice an
out-of-memory failure gets. ``root_cause`` picks which of several failed ranks to blame: the
first to die is not always the one that failed first (a rank that raised or called
``sys.exit(3)`` may still be tearing down when its peer's collective already failed for lack of
it). ``normalise`` strips what differs between two runs of the same failure (addresses, ports,
pids) from a message, for the restart policy's "the same failure twice". Pure functions, no
imports beyond the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dslaunch.launcher.spec import NodeResult

__all__ = ["CAUSES", "classify", "is_oom_text", "is_peer_loss", "root_cause", "normalise", "OOM_REMEDIES",
           "oom_kills"]

CAUSES = ("exit", "signal", "exception", "hang", "host_lost", "oom", "start")

# A collective failing because the rank at its other end went away (gloo, NCCL, the TCP store),
# or a pipeline stage stopping because another stage's batch failed (``PipelineStageError``).
_PEER_LOSS = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|remote process exited|"
                        r"NCCL communicator was aborted|ncclRemoteError|DistNetworkError|"
                        r"the pipeline batch stopped: ")
_OOM_TEXT = re.compile(r"OutOfMemoryError|CUDA out of memory|\bMemoryError\b|CUDA error: out of memory")

OOM_REMEDIES = ("out of memory: try a higher ZeRO stage (zero_optimization.stage 2 or 3), CPU offload "
                "(zero_optimization.offload_optimizer / offload_param), a smaller "
                "train_micro_batch_size_per_gpu (with more gradient_accumulation_steps), or activation "
                "checkpointing")


def is_oom_text(text: str | None) -> bool:
    """Whether a printed exception or traceback says the process ran out of memory."""
    return bool(text) and _OOM_TEXT.search(text) is not None


def is_peer_loss(exception: str | None) -> bool:
    """Whether a rank's exception says a peer went away (an echo of another rank's failure)."""
    return bool(exception) and _PEER_LOSS.search(exception) is not None


def root_cause(first: NodeResult, others: Iterable[NodeResult]) -> NodeResult:
    """The failure to blame.

    The rank that raised first on its own (``raised_at``: the moment it raised, sent by the rank
    at once, before its teardown), whichever process exited first: a rank that raised may still
    be tearing down, or be stopped by the launcher before it printed anything, when a peer it
    left waiting (a pipeline stage it sent a stop, a collective it left) already exited. Without
    such a record (a script without dslaunch's runtime): ``first`` (the first seen), unless it
    only raised because a peer went away; then the one of ``others`` that failed on its own
    (``failed_on_its_own``) first."""
    others = list(others)
    raised = [r for r in (first, *others) if r.raised_at is not None and failed_on_its_own(r)]
    if raised:
        return min(raised, key=lambda r: r.raised_at)
    if not is_peer_loss(first.exception):
        return first
    own = [o for o in others if failed_on_its_own(o)]
    return min(own, key=lambda o: o.failed_at if o.failed_at is not None else float("inf"), default=first)


def failed_on_its_own(r: NodeResult) -> bool:
    """Whether a rank's failure is its own, not an echo of another's: it raised something other
    than a peer loss, or it exited with a code of its own (``sys.exit(3)``), not by the signal
    that stops the ranks after a failure (nor by the code a SIGTERM handler exits with)."""
    if r.rank is None or not r.exit_code:
        return False
    if r.exception is not None:
        return not is_peer_loss(r.exception)
    return r.signal_name is None and not r.ended_by_stop_signal


_VOLATILE = (
    (re.compile(r"0x[0-9a-fA-F]{4,}"), "0x?"),  # object and memory addresses
    (re.compile(r"(?<=[\w\]]):\d{2,5}\b"), ":?"),  # host:port, [ip]:port
    (re.compile(r"\b(port|pid|PID|process) \d+"), r"\1 ?"),
)


def normalise(text: str) -> str:
    """``text`` without what two runs of the same failure do not share: addresses, ports, pids."""
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return text


def classify(exit_code: int, signal_name: str | None, exception: str | None, traceback: str | None,
             oom_killed: bool = False) -> str:
    """The cause of a worker's death (one of ``CAUSES`` except hang/host_lost).

    Args:
        exit_code, signal_name: how it ended.
        exception, traceback: what it printed (the last exception line, the whole traceback).
        oom_killed: the kernel's OOM killer struck on this host while the worker ran.
    """
    if is_oom_text(exception) or is_oom_text(traceback):
        return "oom"
    if signal_name == "SIGKILL" and oom_killed:
        return "oom"
    if exception is not None:
        return "exception"
    return "signal" if signal_name else "exit"


def oom_kills() -> int | None:
    """The kernel's count of OOM kills on this host (``oom_kill`` in /proc/vmstat, Linux >= 4.13)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
