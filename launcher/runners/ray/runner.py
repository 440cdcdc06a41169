"""The Ray runner: one node agent per Ray node, started by an actor pinned to that node.

Launch pipeline (``remote.RemoteRunner``: open, preflight, hand over):

1. reserve the job's nodes as one placement group, ``STRICT_SPREAD``, one bundle per node with its
   slots (``{"GPU": n}`` on GPU nodes, ``{"CPU": n}`` on CPU nodes), each bundle tied to its planned
   node by the ``ray.io/node-id`` label: Ray reserves all of them or none (a busy cluster is one
   clear error after ``PROBE_TIMEOUT``, nothing started);
2. start one ``actor.AgentProcess`` in each bundle; it runs ``agent.bootstrap`` (probe, then the
   agent) with the node's interpreter; its stdout/stderr come back through the actor
   (``RaySession``) and are sorted as any agent's (``stream.AgentStream``). The placement group
   and the actors are the job's (``nodes.RayNodes``): a restart reuses the surviving nodes'
   actors, and their standby agents and warm spares;
3. the probes are checked as over SSH, then each agent gets its NodeSpec.

From then on dslaunch's monitor does the rest, as for SSH and SLURM: heartbeats, hang blame, the
first failure stops the job, restarts and elastic MIN:MAX. A Ray node that dies takes its actor
with it: the controller's pending read fails at once (``ActorUnavailableError``/``ActorDiedError``),
the node is a lost host (cause ``host_lost``), and an elastic job restarts without it. A node that
freezes is caught by the gang's silence rule (``HOST_SILENT_S``).

The placement group and the actors are released when the job ends (a runner given no
``RayNodes``: when its run ends or fails to start); an actor that died or was torn down is
forgotten after its run. If the controller itself dies, Ray ends its actors, and each agent,
finding its stdin closed, stops its workers.
"""

from __future__ import annotations

import queue
import shlex
import threading

from dslaunch.errors import HostsError
from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.envfile import collect_env
from dslaunch.launcher.monitor.gang import NodeHandle
from dslaunch.launcher.runners.base import format_node
from dslaunch.launcher.runners.preflight import PROBE_TIMEOUT, agent_argv, node_request, stderr_tail
from dslaunch.launcher.runners.ray.actor import STREAMS
from dslaunch.launcher.runners.ray.cluster import RayCluster, connect, import_ray
from dslaunch.launcher.runners.ray.nodes import NoRoom, RayNodes, bundle
from dslaunch.launcher.runners.remote import IFACE_AT_LAUNCH, RemoteRunner
from dslaunch.launcher.runners.stream import AgentStream, StreamNode
from dslaunch.launcher.spec import HOST_LOST_EXIT_CODE, JobSpec
from dslaunch.launcher.workerenv import remote_node

__all__ = ["RayRunner", "RayError", "RaySession"]


class RayError(HostsError):
    """One or more Ray nodes could not start their agent. Causes: ``ray`` (no room for the
    placement group, the actor died while starting), ``timeout``, and preflight's."""


class RaySession(AgentStream):
    """One node agent through its ``AgentProcess`` actor (see the module docstring)."""

    def __init__(self, alias: str, actor, out: Sink, err: Sink, on_change=lambda: None) -> None:
        super().__init__(alias, out, err, on_change)
        self._ray = import_ray()
        self.transport_errors = (OSError, EOFError, self._ray.exceptions.RayError)
        self.actor = actor
        self.actor_gone = False
        """The actor died or was torn down: not to be used by another run."""
        self._writes: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._closed = False
        self._started = None  # the actor's answer to start: the agent's pid

    def start(self, request: dict, spares: int = 0) -> None:
        """Start the agent (``AgentProcess.start``); readers and the writer run in threads
        (non-blocking)."""
        self._started = self.actor.start.remote(request, spares)
        stdout, stderr = STREAMS
        self._follow(self._recv(stdout), self._recv(stderr), self._finish, f"ray-{self.alias}")
        threading.Thread(target=self._write_all, daemon=True, name=f"ray-in-{self.alias}").start()

    def _pid(self) -> int:
        """The agent's pid, once it started (raises if the actor never ran)."""
        return self._ray.get(self._started)

    def _recv(self, stream: str):
        def recv(size: int) -> bytes:
            self._pid()  # the first read waits for the agent
            return self._ray.get(self.actor.read.remote(stream, size))
        return recv

    def _write_all(self) -> None:
        """Writes in order, one at a time (a threaded actor would not keep their order)."""
        while (data := self._writes.get()) is not None:
            try:
                self._ray.get(self.actor.write.remote(data, self._pid()))
            except self.transport_errors:
                return
        try:
            self._ray.get(self.actor.close_stdin.remote(self._pid()))
        except self.transport_errors:
            pass

    def _finish(self) -> None:
        try:
            code, lost = self._ray.get(self.actor.wait.remote()), False
        except self._ray.exceptions.RayError as exc:  # the actor (its node) is gone
            self.actor_gone = True
            self._stderr_line(f"ray: {str(exc).splitlines()[0]}\n".encode())
            code, lost = HOST_LOST_EXIT_CODE, True
        self._ended(code, lost=lost or (self.status is None and code != 0))

    def send_line(self, text: str) -> None:
        assert "\n" not in text
        if self._closed or self.done.is_set():
            raise EOFError(f"the agent on {self.alias} is gone")
        self._writes.put((text + "\n").encode())

    def close_stdin(self) -> None:
        if not self._closed:
            self._closed = True
            self._writes.put(None)

    def terminate(self) -> None:
        """Last resort: kill the agent, then its actor."""
        self.actor_gone = True
        try:
            self.actor.kill.remote()
            self._ray.kill(self.actor, no_restart=True)
        except self.transport_errors:
            pass


class _RayNode(StreamNode):
    session: RaySession

    def lost(self) -> tuple[str, str]:
        return (f"lost Ray node {self.node.host} (its agent's actor died without the agent's status)",
                "lost Ray node")

    def kill(self) -> None:
        self.session.terminate()


class RayRunner(RemoteRunner):
    """Runs each node's agent in an actor on that Ray node. See the module docstring."""

    name = "ray"
    error = RayError
    node_type = _RayNode
    cause = "ray"
    lost_on_start = "the Ray node's actor died while starting"

    def __init__(self, nodes: RayNodes | None = None, out_fd: int = 1, err_fd: int = 2) -> None:
        super().__init__(out_fd, err_fd)
        self._owns_nodes = nodes is None
        self._nodes = RayNodes() if nodes is None else nodes

    def _exported(self) -> dict[str, str]:
        # Ray gives each actor the GPUs of its bundle (CUDA_VISIBLE_DEVICES): never the controller's.
        # ray.init points the driver's PYTHONBREAKPOINT at Ray's debugger: not the workers' business.
        return {k: v for k, v in collect_env().items()
                if k != "CUDA_VISIBLE_DEVICES" and not (k == "PYTHONBREAKPOINT" and v.startswith("ray."))}

    @staticmethod
    def _cluster(job: JobSpec) -> RayCluster:
        """The cluster the plan read (the controller joined it then: this only reads it again)."""
        return connect(None if job.ray_address == "local" else job.ray_address)

    def _open_sessions(self, job: JobSpec, wake: threading.Event) -> str:
        cluster = self._cluster(job)
        alive = {n.host: n for n in cluster.nodes}
        gone = [n.host for n in job.nodes if n.host not in alive]
        if gone:
            raise self.error({h: ("ray", "this Ray node is no longer in the cluster") for h in gone})
        try:
            actors = self._nodes.actors(job, cluster)
        except NoRoom as err:
            raise self.error({h: ("ray", f"the Ray cluster did not reserve {_show(b)} on this node within "
                                         f"{PROBE_TIMEOUT:g} s (busy with other jobs, or gone)")
                              for h, b in err.bundles.items()}) from None
        for node in job.nodes:
            session = RaySession(node.host, actors[node.host], self._out, self._err, on_change=wake.set)
            self.sessions[node.host] = session
            session.start(node_request(job, node), self._nodes.spares(node))
        return job.master_addr

    def _diagnose(self, python: str, exit_code: int | None, stderr: str, lost: bool) -> tuple[str, str]:
        tail = stderr_tail(stderr)
        if exit_code is None:
            return "timeout", f"the agent did not answer through its Ray actor in time (node busy?): {tail or 'no output'}"
        if "No module named" in stderr:
            return "interpreter", f"this Ray node's Python cannot import dslaunch: {tail}"
        return "ray", f"the agent's actor ended with code {exit_code}: {tail or 'no output'}"

    def _start_nodes(self, job: JobSpec, wake: threading.Event) -> list[NodeHandle]:
        try:
            return super()._start_nodes(job, wake)
        except BaseException:
            self._release()
            raise

    def wait(self) -> int:
        try:
            return super().wait()
        finally:
            self._release()

    def _release(self) -> None:
        """Forget the actors that are gone or were torn down; end them all when the runner owns
        its nodes (no job-wide ``RayNodes`` given)."""
        for host, session in self.sessions.items():
            if session.actor_gone:
                self._nodes.forget(host)
        if self._owns_nodes:
            self._nodes.close()

    def dry_run(self, job: JobSpec) -> str:
        gpus = {n.host: n.gpus for n in self._cluster(job).nodes}
        out = [f"# Ray cluster {job.ray_address}: placement group STRICT_SPREAD, one bundle per node"]
        for node in job.nodes:
            out.append(f"# actor on Ray node {node.host} ({_show(bundle(node, gpus.get(node.host, 0)))}) runs: "
                       f"{shlex.join(agent_argv('<node python>', node_request(job, node)))}\n"
                       "  # stdin: the NodeSpec below (env, cwd, workers) as one JSON line")
            out.append(format_node(remote_node(node, job.master_addr, self._exported(), IFACE_AT_LAUNCH)))
        return "\n".join(out)


def _show(res: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in res.items())

