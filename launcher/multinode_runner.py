"""DeepSpeed's ``deepspeed.launcher.multinode_runner``: the base class of its per-backend runners.

dslaunch's runners (``launcher/runners/``: ssh with its own agent, SLURM, local) take a typed
``LaunchConfig``, not argparse namespaces, and dslaunch has no pdsh or MPI runner, so DeepSpeed's
``PDSHRunner``, ``OpenMPIRunner``, ``MPICHRunner``, ``IMPIRunner``, ``MVAPICHRunner`` and
``SlurmRunner`` import but refuse to be made, in one line naming the launcher flag to use. What
works: ``MultiNodeRunner``, the base a script subclasses for its own backend, with
DeepSpeed's constructor and its rule for exported values (quoted when the shell would read
them otherwise).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

from dslaunch.utils.refused import Refusal, refuse

_OTHER_HOSTS = ("PDSHRunner", "OpenMPIRunner", "MPICHRunner", "IMPIRunner", "MVAPICHRunner")
globals().update(refuse(__name__, _OTHER_HOSTS,
                        Refusal("DeepSpeed's pdsh/MPI runner class", "dslaunch starts every host over its own SSH "
                                "agent: run `dslaunch --hostfile ...` (the default --launcher ssh)")))
_SRUN = ("SlurmRunner",)
globals().update(refuse(__name__, _SRUN,
                        Refusal("DeepSpeed's srun runner class", "run `dslaunch --launcher slurm` or `dslaunch sbatch`")))

__all__ = ["MultiNodeRunner", *_OTHER_HOSTS, *_SRUN]

# Characters a shell reads literally in an unquoted word (DeepSpeed's set).
_PLAIN = re.compile(r"[\w@%+=:,./-]*")


class MultiNodeRunner(ABC):
    """A launcher backend: ``get_cmd`` builds the command that starts the job on every node.

    Args:
        args: the launcher's parsed arguments (``user_script``, ``user_args`` are read).
        world_info_base64: the hosts and slots, as the launcher encodes them.
    """

    def __init__(self, args: Any, world_info_base64: str):
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether the backend's tool is installed."""

    @abstractmethod
    def get_cmd(self, environment: dict[str, str], active_resources: Any) -> list[str]:
        """The command that starts the job."""

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to every worker; a value with characters a shell would interpret
        (``64(x2)``, spaces) is double-quoted, a plain one (a path) is left as it is."""
        var = var.strip()
        self.exports[key.strip()] = var if _PLAIN.fullmatch(var) else f'"{var}"'

    def parse_user_args(self) -> list[str]:
        return self.args.user_args

    def validate_args(self) -> None:  # noqa: B027 (optional hook, as DeepSpeed's)
        """Check ``self.args`` for this backend (nothing by default)."""

    @property
    def name(self) -> str:
        return type(self).__name__
