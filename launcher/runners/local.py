"""The local runner: the node agent runs inside the controller process (no extra interpreter).

Only for jobs whose nodes are all this machine (one node: localhost).
"""

from __future__ import annotations

import signal
import threading

from dslaunch.errors import UsageError
from dslaunch.launcher.agent.node import Agent
from dslaunch.launcher.agent.spare import SparePool
from dslaunch.launcher.monitor.gang import NodeHandle
from dslaunch.launcher.runners.base import Runner, format_node
from dslaunch.launcher.spec import JobSpec, NodeResult
from dslaunch.utils.beat import Beat

__all__ = ["LocalRunner"]


class _InProcessNode(NodeHandle):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.node = agent.node
        self._stacks: dict[int, dict] | None = {}

    def poll(self) -> NodeResult | None:
        return self.agent.poll()

    def failing(self) -> NodeResult | None:
        return self.agent.failure

    def stop(self, sig: int) -> None:
        self.agent.stop(sig)

    def kill(self) -> None:
        self.agent.stop(signal.SIGKILL)

    def beats(self) -> dict[int, Beat]:
        return self.agent.beats()

    def request_stacks(self) -> None:
        self._stacks = None
        def dump() -> None:
            self._stacks = self.agent.dump_stacks()
        threading.Thread(target=dump, daemon=True, name="dump-stacks").start()

    def stacks(self) -> dict[int, dict] | None:
        return self._stacks


class LocalRunner(Runner):
    """Runs the single local node in-process. Call ``start`` from the main thread of a process
    that exists for this job (it becomes the workers' subreaper, see ``Agent``).

    Args:
        spares: warm spare workers kept across the job's runs (``agent.spare``): this run's
            workers are handed to those ready, and the pool is refilled for the next run.
    """

    name = "local"

    def __init__(self, spares: SparePool | None = None) -> None:
        super().__init__()
        self._spares = spares

    def _start_nodes(self, job: JobSpec, wake: threading.Event) -> list[NodeHandle]:
        if len(job.nodes) != 1:
            raise UsageError(f"the local launcher runs one node, got {len(job.nodes)}: {', '.join(job.hosts)}")
        # The CLI process is the job's: it adopts orphans and owns the spares.
        agent = Agent(job.nodes[0], on_change=wake.set, adopt_orphans=True, spares=self._spares)
        agent.start()
        if self._spares is not None:
            self._spares.fill(len(job.nodes[0].workers))
        return [_InProcessNode(agent)]

    def dry_run(self, job: JobSpec) -> str:
        return "\n".join(format_node(n) for n in job.nodes)
