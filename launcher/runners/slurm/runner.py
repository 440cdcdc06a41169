"""The SLURM runner: inside an allocation, one node agent per node through ``srun``.

Launch pipeline (``remote.RemoteRunner``: open, preflight, hand over), every node in parallel:

1. start ``srun --nodes=1 --ntasks=1 --nodelist=<node> --overlap ... <agent bootstrap>`` for each
   node: a job step per node, so SLURM accounts for and can signal every process of the job;
2. the preflight probes (``runners.preflight``: interpreter, cwd, script, versions, master
   address and port) come back on srun's stdout; on any problem close every srun's stdin (the
   agents see EOF and exit) and raise ``SlurmError`` naming each node and cause;
3. send each agent its NodeSpec, with the env files' variables and the interface toward the
   master address that node's probe found (``workerenv.remote_node``).

The same agent and bootstrap as the SSH runner; only the transport differs. ``MASTER_ADDR`` is the
first node of the job (or ``--master_addr``). srun passes the controller's whole environment on to
the step, so ``CUDA_VISIBLE_DEVICES`` is the one SLURM gives the step, never the controller's.
``--launcher_args`` are extra srun options, verbatim.

Stopping: closing an srun's stdin makes its agent stop its workers (SIGTERM, then SIGKILL after the
grace period) and exit; a node that does not is terminated through srun (SIGTERM to srun: SLURM
signals the step, then kills it). An srun that ends without the agent's status line (node lost,
step killed) is a lost host, and so is a node silent for the gang's ``HOST_SILENT_S`` (the agent
speaks every second; the controller sends it ``ALIVE`` every second the other way).
"""

from __future__ import annotations

import os
import re
import shlex

from dslaunch.errors import HostsError
from dslaunch.launcher.agent.wire import CHECKPOINT_REQUEST
from dslaunch.launcher.envfile import collect_env
from dslaunch.launcher.runners.child import ChildNode, ChildRunner
from dslaunch.launcher.runners.preflight import node_agent_argv
from dslaunch.launcher.spec import JobSpec, NodeSpec

__all__ = ["SlurmRunner", "SlurmError", "srun_argv"]

SRUN = "srun"
# srun's own line after the agent's status line said the same (and named the rank)
_SRUN_EXIT_LINE = re.compile(rb"srun: error: \S+: task \d+: Exited with exit code \d+\s*$")


class SlurmError(HostsError):
    """One or more nodes could not start their agent through srun. Causes: ``srun`` (srun could
    not start or ended early), ``timeout``, and preflight's (``interpreter``, ``cwd``, ...)."""


def srun_argv(job: JobSpec, node: NodeSpec, cpus: int | None = None) -> list[str]:
    """The srun command line that starts ``node``'s agent (probe first, see ``agent.bootstrap``).

    ``--overlap``: the agent's step never waits for, nor blocks, another step of the job.
    ``--cpus-per-task``: all the node's CPUs, so that a task plugin that pins steps does not pin
    every worker of the node to one CPU.
    """
    opts = ["--nodes=1", "--ntasks=1", f"--nodelist={node.host}", "--overlap", "--quiet",
            f"--job-name=dslaunch-node{node.node_rank}", *([f"--cpus-per-task={cpus}"] if cpus else []),
            *shlex.split(job.launcher_args)]
    return [SRUN, *opts, *node_agent_argv(job, node)]


class _SrunNode(ChildNode):
    command = SRUN


class SlurmRunner(ChildRunner):
    """Runs each node's agent as a step of the current SLURM job. See the module docstring."""

    name = "slurm"
    error = SlurmError
    node_type = _SrunNode
    cause = "srun"
    lost_on_start = "srun ended while starting the node"

    def _exported(self) -> dict[str, str]:
        # srun hands the step the controller's whole environment already; CUDA_VISIBLE_DEVICES
        # must stay the one SLURM sets for the step on its node.
        return {k: v for k, v in collect_env().items() if k != "CUDA_VISIBLE_DEVICES"}

    @staticmethod
    def _cpus() -> dict[str, int]:
        """Each node's CPUs in the allocation (for ``--cpus-per-task``), if SLURM says."""
        from dslaunch.launcher.runners.slurm.allocation import from_env

        alloc = from_env(os.environ)
        return dict(zip(alloc.hosts, alloc.cpus, strict=True)) if alloc and alloc.cpus else {}

    epilogue = _SRUN_EXIT_LINE

    def _argvs(self, job: JobSpec) -> dict[str, list[str]]:
        cpus = self._cpus()  # the allocation read once per job
        return {node.host: srun_argv(job, node, cpus.get(node.host)) for node in job.nodes}

    def request_checkpoint(self) -> None:
        """Ask every node's agent to signal its ranks for a checkpoint (signal-handler safe:
        the stdin lock is reentrant)."""
        for s in self.sessions.values():
            try:
                s.send_line(CHECKPOINT_REQUEST)
            except (OSError, ValueError, AssertionError):
                pass  # that node's agent is gone: nothing to ask
