"""One node agent started through a local child command whose stdio is the agent's channel:
``srun`` (the SLURM runner) or ``mpirun``/``mpiexec`` (the MPI runners).

``ChildSession`` runs ``<launcher> <one task on node> python -m dslaunch.launcher.agent.bootstrap
'<request>'`` as a child process in a session of its own (a terminal's Ctrl-C reaches the controller
only; srun would otherwise take it as its own "status, then abort" interrupt) and sorts its output
with ``stream.AgentStream``. ``send_line`` writes to the command's stdin, which srun and mpirun
forward to their one task, the agent; ``close_stdin`` is the stop request (the agent sees EOF and
stops its workers, as over SSH). ``terminate`` is the last resort: SIGTERM to the command, which
signals its task and kills it after a grace period (SLURM's ``KillWait``, mpirun's own).

A runner may give its command a private scratch directory (``scratch_env``: the variable that
names it): made before the command starts, removed once it has exited. Open MPI's mpirun needs one:
every mpirun of a user on a host shares one session-directory root (``/tmp/ompi.<host>.<uid>``), and
one exiting removes that root when it looks empty while another is creating its directory in it
(``orte_session_dir failed``: reproduced here in 1 of 500 starts with two mpiruns looping).

Once the agent's status line is in, the command's own report of the same exit (srun's "task 0:
Exited with exit code", mpirun's boxed "process returned a non-zero exit code") says nothing new:
``epilogue`` tells those lines apart and they are dropped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import ClassVar

from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.runners.base import format_node
from dslaunch.launcher.runners.preflight import stderr_tail
from dslaunch.launcher.runners.remote import IFACE_AT_LAUNCH, RemoteRunner
from dslaunch.launcher.runners.stream import AgentStream, StreamNode
from dslaunch.launcher.spec import JobSpec
from dslaunch.launcher.workerenv import remote_node
from dslaunch.safe_write import private_temp_dir

__all__ = ["ChildSession", "ChildNode", "ChildRunner"]


class ChildSession(AgentStream):
    """A child command whose stdio is one node agent's. Thread-safe for the methods below.

    Args:
        epilogue: which of the command's stderr lines after the agent's status line are its own
            report of that exit (dropped).
        scratch_env: the environment variable that gives the command a private scratch directory
            (made at ``start``, removed when the command has exited); None: none.
    """

    def __init__(self, alias: str, argv: list[str], out: Sink, err: Sink,
                 on_change: Callable[[], None] = lambda: None,
                 epilogue: re.Pattern[bytes] | None = None, scratch_env: str | None = None) -> None:
        super().__init__(alias, out, err, on_change)
        self.argv = argv
        self.epilogue = epilogue
        self.scratch_env = scratch_env
        self.scratch: str | None = None
        self._proc: subprocess.Popen | None = None
        self._stdin_lock = threading.RLock()  # reentrant: a signal handler may write a request

    def start(self) -> None:
        """Start the command; readers run in threads. Raises OSError when it cannot be executed."""
        env = None
        if self.scratch_env is not None:
            self.scratch = private_temp_dir(f"dslaunch-{os.path.basename(self.argv[0])}-")
            env = {**os.environ, self.scratch_env: self.scratch}
        try:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, bufsize=0, start_new_session=True, env=env)
        except OSError:
            self._remove_scratch()
            raise
        self._proc = proc
        self._follow(_reader(proc.stdout), _reader(proc.stderr), lambda: self._finish(proc),
                     f"{os.path.basename(self.argv[0])}-{self.alias}")

    def _finish(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self._remove_scratch()
        # the command ends without the agent's status line when the node or the step was lost
        self._ended(128 - code if code < 0 else code, lost=self.status is None and code != 0)

    def _remove_scratch(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _stderr_line(self, line: bytes) -> None:
        if self.status is not None and self.epilogue is not None and self.epilogue.match(line):
            return
        super()._stderr_line(line)

    def send_line(self, text: str) -> None:
        assert self._proc is not None and "\n" not in text
        with self._stdin_lock:
            self._proc.stdin.write((text + "\n").encode())
            self._proc.stdin.flush()

    def close_stdin(self) -> None:
        """EOF on the agent's stdin: it stops its workers and exits. Non-blocking, idempotent."""
        if self._proc is not None:
            with self._stdin_lock:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass

    def terminate(self) -> None:
        """Last resort: SIGTERM to the command (it signals, then kills, its task)."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.kill(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _reader(stream) -> Callable[[int], bytes]:
    fd = stream.fileno()
    return lambda n: os.read(fd, n)


class ChildNode(StreamNode):
    """A node agent seen through its launcher command (``runner.cause`` names it)."""

    session: ChildSession
    command: ClassVar[str] = ""

    def lost(self) -> tuple[str, str]:
        return (f"lost node {self.node.host} ({self.command} exited with {self.session.exit_code} without the "
                "agent's status)", f"lost {self.command} step")

    def kill(self) -> None:
        self.session.terminate()


class ChildRunner(RemoteRunner):
    """A remote runner whose session to each node is a local child command (``srun``,
    ``mpirun``) running that node's agent. Subclasses set ``cause`` (the command's name),
    ``epilogue`` and ``node_type`` (a ``ChildNode`` with that ``command``) and implement ``_argvs``."""

    epilogue: ClassVar[re.Pattern[bytes] | None] = None
    scratch_env: ClassVar[str | None] = None
    """The variable that gives each node's command a private scratch directory (see the module)."""

    def _argvs(self, job: JobSpec) -> dict[str, list[str]]:
        """Each node's command line that starts its agent (probe first, see ``agent.bootstrap``)."""
        raise NotImplementedError

    def dry_run(self, job: JobSpec) -> str:
        exported, argvs = self._exported(), self._argvs(job)
        out = []
        for node in job.nodes:
            scratch = (f"\n  # env: {self.scratch_env}=<a private directory, removed when it exits>"
                       if self.scratch_env else "")
            out.append(f"{shlex.join(argvs[node.host])}{scratch}\n"
                       "  # stdin: the NodeSpec below (env, cwd, workers) as one JSON line")
            out.append(format_node(remote_node(node, job.master_addr, exported, IFACE_AT_LAUNCH)))
        return "\n".join(out)

    def _open_sessions(self, job: JobSpec, wake: threading.Event) -> str:
        argvs = self._argvs(job)
        for node in job.nodes:
            session = ChildSession(node.host, argvs[node.host], self._out, self._err, on_change=wake.set,
                                   epilogue=self.epilogue, scratch_env=self.scratch_env)
            self.sessions[node.host] = session
            try:
                session.start()
            except OSError as exc:
                raise self.error({n.host: (self.cause, f"cannot run {self.cause}: {exc.strerror or exc}")
                                  for n in job.nodes}) from None
        return job.master_addr

    def _diagnose(self, python: str, exit_code: int | None, stderr: str, lost: bool) -> tuple[str, str]:
        """Why a node answered without a probe line: (cause, message)."""
        tail = stderr_tail(stderr)
        if exit_code is None:
            return "timeout", f"the agent did not answer through {self.cause} in time (node busy?): {tail or 'no output'}"
        if "No module named" in stderr:
            return "interpreter", f"{python} cannot import dslaunch on this node: {tail}"
        if "No such file or directory" in stderr and python in stderr:
            return "interpreter", (f"python interpreter {python} not found on this node; the controller's "
                                   "interpreter path must exist on every node")
        return self.cause, f"{self.cause} exited with code {exit_code}: {tail or 'no output'}"
