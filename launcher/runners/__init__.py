"""Runners start node agents on hosts: one module per transport.

``base.py``: the ``Runner`` interface (start a job's node agents, then run the gang loop);
``local.py``: the agent inside the controller process (one node, this machine); ``remote.py``:
what every runner of remote agents shares (a session per node, preflight, hand over), with
``preflight.py`` (is every host ready) and ``stream.py`` (an agent's streams, line by line);
``ssh/`` (paramiko), ``slurm/`` (``srun``) and ``mpi.py`` (the site's ``mpirun``), the last two
through ``child.py`` (an agent behind a local child command), and ``ray/`` (an actor per Ray node
running its agent).

``RUNNERS`` maps a ``--launcher`` name to a lazy ``"module:Class"`` string, so choosing the
local runner never imports paramiko. ``get_runner(name)`` resolves it.
"""

from __future__ import annotations

import importlib

from dslaunch.errors import UsageError, did_you_mean

__all__ = ["RUNNERS", "get_runner"]

RUNNERS: dict[str, str] = {
    "local": "dslaunch.launcher.runners.local:LocalRunner",
    "ssh": "dslaunch.launcher.runners.ssh.runner:SSHRunner",
    "slurm": "dslaunch.launcher.runners.slurm.runner:SlurmRunner",
    "openmpi": "dslaunch.launcher.runners.mpi:OpenMPIRunner",
    "mpich": "dslaunch.launcher.runners.mpi:MPICHRunner",
    "impi": "dslaunch.launcher.runners.mpi:IMPIRunner",
    "mvapich": "dslaunch.launcher.runners.mpi:MVAPICHRunner",
    "ray": "dslaunch.launcher.runners.ray.runner:RayRunner",
}

# DeepSpeed's other launcher names, answered with a clear "not supported" instead of a typo hint.
_UNSUPPORTED = ("pdsh",)


def get_runner(name: str):
    """Return the runner class registered as ``name``.

    Raises:
        UsageError: unknown or unsupported launcher name.
    """
    target = RUNNERS.get(name)
    if target is None:
        if name in _UNSUPPORTED:
            raise UsageError(f"--launcher {name} is not supported yet; available: {', '.join(RUNNERS)}")
        raise UsageError(f"unknown --launcher {name!r}{did_you_mean(name, RUNNERS)}; "
                         f"available: {', '.join(RUNNERS)}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
