"""The MPI runners (``--launcher openmpi|mpich|impi|mvapich``): one node agent per host through the
site's ``mpirun``.

DeepSpeed's MPI launchers start every rank with one ``mpirun`` and leave the ranks to find each
other (``mpi_discovery``); nothing watches them. Here ``mpirun`` is only the transport, as ``srun``
is for the SLURM runner: one ``mpirun`` per host starts one task, that host's agent, whose stdio is
the channel (``child.ChildSession``: Open MPI and Hydra forward stdin to their one task and its EOF).
The agent then starts the host's workers with the launcher's environment, and the monitor,
heartbeats, hang blame and restarts are the same as over SSH. mpirun reaches other hosts its own
way (Open MPI's ``plm_rsh_agent``, Hydra's bootstrap: ssh by default, or the batch system's).

Per flavour (``--launcher_args`` are extra mpirun options, verbatim, before the command):

- ``openmpi``: ``mpirun -n 1 --host H --bind-to none`` (the agent binds its workers itself, with
  ``--bind_cores_to_rank``); ``--allow-run-as-root`` when the controller runs as root (containers);
  each mpirun keeps its session directory in a private one (``OMPI_MCA_orte_local_tmpdir_base``,
  Open MPI 4's name), so the job's per-host mpiruns and other jobs' on the same machine never race
  over the shared one (``child``'s ``scratch_env``); the hosts' daemons keep their default;
- ``mpich``, ``impi``, ``mvapich`` (Hydra's ``mpirun``): ``mpirun -n 1 -hosts H``.

Open MPI is tested for real (Debian's 4.1, tests/launcher/runners/test_mpi.py); the Hydra forms
are checked against their documented options only.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import ClassVar

from dslaunch.errors import HostsError
from dslaunch.launcher.runners.child import ChildNode, ChildRunner
from dslaunch.launcher.runners.preflight import node_agent_argv
from dslaunch.launcher.spec import JobSpec

__all__ = ["MPIError", "OpenMPIRunner", "MPICHRunner", "IMPIRunner", "MVAPICHRunner"]

MPIRUN = "mpirun"


class MPIError(HostsError):
    """One or more hosts could not start their agent through mpirun. Causes: ``mpirun`` (it could
    not start or ended early), ``timeout``, and preflight's (``interpreter``, ``cwd``, ...)."""


class _MpirunNode(ChildNode):
    command = MPIRUN


class _MPIRunner(ChildRunner):
    error = MPIError
    node_type = _MpirunNode
    cause = MPIRUN
    lost_on_start = "mpirun ended while starting the host"
    # after the agent's status line, whatever mpirun prints is its own boxed report of that exit
    epilogue = re.compile(rb"")
    placement: ClassVar[tuple[str, ...]] = ()
    """The options that run one task on the host (``{host}`` replaced)."""

    def _options(self) -> tuple[str, ...]:
        return self.placement

    def _argvs(self, job: JobSpec) -> dict[str, list[str]]:
        return {node.host: [MPIRUN, *(o.format(host=node.host) for o in self._options()),
                            *shlex.split(job.launcher_args), *node_agent_argv(job, node)] for node in job.nodes}


class OpenMPIRunner(_MPIRunner):
    name = "openmpi"
    placement = ("-n", "1", "--host", "{host}", "--bind-to", "none")
    scratch_env = "OMPI_MCA_orte_local_tmpdir_base"

    def _options(self) -> tuple[str, ...]:
        return (("--allow-run-as-root",) if os.geteuid() == 0 else ()) + self.placement


class MPICHRunner(_MPIRunner):
    name = "mpich"
    placement = ("-n", "1", "-hosts", "{host}")


class IMPIRunner(MPICHRunner):
    name = "impi"


class MVAPICHRunner(MPICHRunner):
    name = "mvapich"
