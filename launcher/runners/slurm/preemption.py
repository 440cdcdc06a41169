"""SLURM's warning before a time limit or pre-emption, turned into a checkpoint and a requeue.

``dslaunch sbatch --resume_from DIR`` asks SLURM for ``--signal=B:USR1@120``: SIGUSR1 to the batch
shell, which is dslaunch (``exec``), two minutes before the end. ``Preemption`` takes that signal
and asks every node agent for a checkpoint (``wire.CHECKPOINT_REQUEST``); each agent signals its
ranks, which agree on a step, save it into DIR and leave (``runtime.preempt``). Once the job has
ended, ``requeue`` puts it back in the queue when SLURM allows requeueing it (``Requeue=1``, from
``sbatch --requeue`` or the cluster's default), and the requeued job resumes from DIR
(``SLURM_RESTART_COUNT`` counts as a restart: ``initialize()`` loads the newest checkpoint).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dslaunch.utils.beat import CHECKPOINT_SIGNAL

__all__ = ["Preemption"]


class Preemption:
    """Usage: ``install()``; ``track(runner)`` for every run's runner; ``restore()``; ``requeue()``.
    Not ``enabled`` (a job that does not run through SLURM): every method does nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.requested = False
        self._runner = None
        self._previous = None

    def track(self, runner):  # -> the same runner
        self._runner = runner
        return runner

    def install(self) -> None:
        if self.enabled:
            self._previous = signal.signal(CHECKPOINT_SIGNAL, self._on_signal)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(CHECKPOINT_SIGNAL, self._previous)

    def _on_signal(self, _signum: int, _frame: object) -> None:
        first = not self.requested
        self.requested = True
        if first and self._runner is not None:
            os.write(2, b"dslaunch: SLURM's warning signal: asking every rank for a checkpoint\n")
            self._runner.request_checkpoint()

    def requeue(self, job_id: str) -> bool:
        """Requeue SLURM job ``job_id`` when it may be requeued; say what happened. True if requeued."""
        show = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=60)
        fields = dict(kv.split("=", 1) for kv in show.stdout.split() if "=" in kv)
        if fields.get("Requeue") != "1":
            print(f"dslaunch: job {job_id} is not requeueable (sbatch --requeue): not requeued; resume it "
                  "by submitting it again", file=sys.stderr, flush=True)
            return False
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            print(f"dslaunch: scontrol requeue {job_id} failed: {done.stderr.strip()[:300]}", file=sys.stderr,
                  flush=True)
            return False
        restarts = int(fields.get("Restarts", "0")) + 1
        print(f"dslaunch: job {job_id} requeued (restart {restarts}); it resumes from the checkpoint",
              file=sys.stderr, flush=True)
        return True
