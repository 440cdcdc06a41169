"""DeepSpeed's ``deepspeed.launcher.multinode_runner``: its per-backend runners as command builders.

``get_cmd(environment, active_resources)`` builds the command DeepSpeed's ``deepspeed --launcher X``
would start; nothing here runs it. dslaunch's own ``--launcher`` runs ``ssh`` (its agent), ``slurm``
and ``local`` (``launcher/runners/``); these classes serve scripts that subclass, patch or call
DeepSpeed's runners. Where DeepSpeed's command names a DeepSpeed-only program, dslaunch's is used:

- ``PDSHRunner``: each node runs ``dslaunch --no_ssh --node_rank=%n`` for its share of the pool
  (pdsh fills in ``%n``), with the hostfile and the pool as ``--include``; DeepSpeed's runs its
  ``deepspeed.launcher.launch``.
- ``OpenMPIRunner``, ``MPICHRunner``, ``IMPIRunner``, ``MVAPICHRunner``, ``SlurmRunner``: every rank
  is the user script under ``mpirun``/``srun`` (MPICH: no DeepSpeed helper script in between); the
  script finds its rank in the MPI/SLURM environment, which dslaunch's ``init_distributed`` does not
  read yet (issue 41). MPICH/IMPI/MVAPICH use Hydra's ``-genv NAME VALUE``/``-env NAME VALUE`` and
  MVAPICH gets ``-hosts`` instead of a hostfile DeepSpeed writes to ``/tmp``; ``SlurmRunner`` turns
  ``--include``/``--exclude`` into srun's ``--nodelist``/``--exclude`` (hosts only).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from dslaunch.errors import NotInDslaunchError, UsageError
from dslaunch.launcher import gpus
from dslaunch.launcher.hostfile import parse_filter

__all__ = ["MultiNodeRunner", "PDSHRunner", "OpenMPIRunner", "MPICHRunner", "IMPIRunner", "MVAPICHRunner",
           "SlurmRunner", "PDSH_MAX_FAN_OUT"]

PDSH_MAX_FAN_OUT = 1024  # pdsh -f: hosts contacted at once (DeepSpeed's)
# Characters a shell reads literally in an unquoted word (DeepSpeed's set).
_PLAIN = re.compile(r"[\w@%+=:,./-]*")
Resources = Mapping[str, int | Sequence[int]]  # host -> slot count, or its slot indices


class MultiNodeRunner(ABC):
    """A launcher backend: ``get_cmd`` builds the command that starts the job on every node.

    Args:
        args: the launcher's parsed arguments (``runner.parse_args``).
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
    def get_cmd(self, environment: dict[str, str], active_resources: Any) -> Any:
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

    def _launcher_args(self) -> list[str]:
        try:
            return shlex.split(self.args.launcher_args)
        except ValueError as err:  # "No closing quotation"
            raise UsageError(f"--launcher_args {self.args.launcher_args!r}: {err}") from None

    def _python(self) -> list[str]:
        """What runs the user script: the interpreter (``-m`` for ``--module``), or nothing."""
        if self.args.no_python:
            return []
        return [sys.executable, "-u", *(["-m"] if self.args.module else [])]


class PDSHRunner(MultiNodeRunner):
    """pdsh over ssh; each node runs dslaunch's agent for its slots. ``get_cmd`` returns the
    command, the command that kills the nodes' agents, and ``environment`` with pdsh's variables."""

    name = "pdsh"  # type: ignore[assignment]

    def backend_exists(self) -> bool:
        return shutil.which("pdsh") is not None

    def parse_user_args(self) -> list[str]:
        return [shlex.quote(a) for a in self.args.user_args]  # pdsh joins the command into one shell line

    def get_cmd(self, environment: dict[str, str], active_resources: Resources
                ) -> tuple[list[str], list[str], dict[str, str]]:
        environment["PDSH_RCMD_TYPE"] = "ssh"
        if self.args.ssh_port is not None:
            environment["PDSH_SSH_ARGS_APPEND"] = " ".join(
                [environment.get("PDSH_SSH_ARGS_APPEND", ""), f"-p {self.args.ssh_port}"]).strip()
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(active_resources),
                *self._launcher_args()]
        agent = [sys.executable, "-u", "-m", "dslaunch.launcher.cli", "--no_ssh", "--node_rank=%n",
                 f"--hostfile={os.path.abspath(self.args.hostfile)}", f"--include={_as_include(active_resources)}",
                 f"--master_addr={self.args.master_addr or next(iter(active_resources))}",
                 f"--master_port={self.args.master_port}"]
        setup = "".join(f"export {k}={v}; " for k, v in self.exports.items())
        setup += f"cd {shlex.quote(os.path.abspath('.'))};"
        if getattr(self.args, "venv_script", None):
            setup = f"source {shlex.quote(self.args.venv_script)}; {setup}"
        # '[d]slaunch...' matches the agent's command line but not the shell running pkill.
        kill = [*pdsh, f"pkill -f {shlex.quote('[d]' + ' '.join(agent[3:8])[1:])}"]
        return [*pdsh, setup, *agent, *self._agent_flags(), self.user_script, *self.user_arguments], kill, environment

    def _agent_flags(self) -> list[str]:
        a = self.args
        flags = [f"--{name}" for name in ("module", "no_python", "no_local_rank", "bind_cores_to_rank")
                 if getattr(a, name, False)]
        if a.bind_core_list:
            flags.append(f"--bind_core_list={a.bind_core_list}")
        if a.enable_each_rank_log not in (None, "None"):
            flags.append(f"--enable_each_rank_log={a.enable_each_rank_log}")
        return flags


class _PoolRunner(MultiNodeRunner):
    """A backend that starts every rank from one command here (mpirun, srun) on the whole pool.

    Args:
        resource_pool: the hostfile's ``{host: slots}``.
    """

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Resources):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def validate_args(self) -> None:
        """MPI starts every slot of the hostfile: DeepSpeed refuses the flags that pick some."""
        if self.args.include or self.args.exclude:
            raise UsageError(f"the {self.name} launcher starts every slot of the hostfile: "
                             "--include/--exclude cannot be used with it")
        if self.args.num_nodes != -1 or self.args.num_gpus != -1:
            raise UsageError(f"the {self.name} launcher starts every slot of the hostfile: "
                             "--num_nodes/--num_gpus cannot be used with it")

    def _world(self) -> int:
        return sum(_counts(self.resource_pool).values())

    def _per_node(self) -> int:
        """Ranks per host, the same on every host (``-ppn``)."""
        counts = _counts(self.resource_pool)
        if len(set(counts.values())) > 1:
            raise UsageError(f"the {self.name} launcher starts the same number of ranks on every host; "
                             f"the hostfile has {', '.join(f'{h}={n}' for h, n in counts.items())}")
        return next(iter(counts.values()))

    def _rendezvous(self, flag: str) -> list[str]:
        """Hydra's ``-genv NAME VALUE`` for the master, the world and the ranks per node."""
        master = self.args.master_addr or next(iter(self.resource_pool))
        values = {**self.exports, "MASTER_ADDR": master, "MASTER_PORT": self.args.master_port,
                  "WORLD_SIZE": self._world(), "LOCAL_SIZE": self._per_node()}
        return [word for k, v in values.items() for word in (flag, k, str(v))]


class OpenMPIRunner(_PoolRunner):
    """Open MPI's ``mpirun`` on the hostfile; ``--mca btl_tcp_if_include eth0`` unless
    ``--launcher_args`` names that parameter."""

    name = "openmpi"  # type: ignore[assignment]

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Resources):
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("UCX_TLS", "tcp")

    def backend_exists(self) -> bool:
        return shutil.which("ompi_info") is not None

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        extra = self._launcher_args()
        named = any(a in ("-mca", "--mca") and b == "btl_tcp_if_include" for a, b in zip(extra, extra[1:], strict=False))
        nic = [] if named else ["--mca", "btl_tcp_if_include", "eth0"]
        exports = [word for k, v in self.exports.items() for word in ("-x", f"{k}={v}")]
        return ["mpirun", "-n", str(self._world()), "-hostfile", self.args.hostfile, "--mca", "btl", "^openib",
                *nic, *extra, *exports, *self._python(), self.user_script, *self.user_arguments]


class MPICHRunner(_PoolRunner):
    """MPICH's (Hydra) ``mpirun``: the same ranks on every host."""

    name = "mpich"  # type: ignore[assignment]

    def backend_exists(self) -> bool:
        return shutil.which("mpirun") is not None

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        return ["mpirun", "-n", str(self._world()), "-ppn", str(self._per_node()), *self._launcher_args(),
                *self._rendezvous("-genv"), "-hosts", ",".join(self.resource_pool),
                *self._python(), self.user_script, *self.user_arguments]


class IMPIRunner(_PoolRunner):
    """Intel MPI's ``mpirun``: one ``-n 1`` section per rank with its ``RANK`` and ``LOCAL_RANK``."""

    name = "impi"  # type: ignore[assignment]

    def backend_exists(self) -> bool:
        return shutil.which("mpirun") is not None

    def validate_args(self) -> None:
        super().validate_args()
        if self.args.bind_cores_to_rank:
            raise NotInDslaunchError("IMPIRunner with --bind_cores_to_rank (DeepSpeed's numactl per rank) is "
                                     "not in dslaunch; use dslaunch --bind_cores_to_rank (ssh or local launcher)")

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        per_node = self._per_node()
        cmd = ["mpirun", "-ppn", str(per_node), *self._launcher_args(), *self._rendezvous("-genv"),
               "-genv", "I_MPI_PIN", "0", "-hosts", ",".join(self.resource_pool)]
        for rank in range(self._world()):
            cmd += [":"] if rank else []
            cmd += ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(rank % per_node),
                    *self._python(), self.user_script, *self.user_arguments]
        return cmd


class MVAPICHRunner(_PoolRunner):
    """MVAPICH2-GDR's ``mpirun`` with DeepSpeed's MV2 settings."""

    name = "mvapich"  # type: ignore[assignment]

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Resources):
        super().__init__(args, world_info_base64, resource_pool)
        settings = {"MV2_SMP_USE_CMA": "0", "MV2_DEBUG_SHOW_BACKTRACE": "1", "MV2_SUPPORT_DL": "1",
                    "MV2_ENABLE_AFFINITY": "0", "MV2_INTER_ALLGATHER_TUNING": "5", "MV2_CUDA_USE_NAIVE": "0"}
        if gpus.detect().kind == "cuda":
            settings["MV2_USE_CUDA"] = "1"  # CUDA-aware communication
        for key, value in settings.items():
            self.add_export(key, value)

    def backend_exists(self) -> bool:
        """``mpiname`` reports MVAPICH2-GDR (DeepSpeed's check)."""
        if shutil.which("mpiname") is None:
            return False
        found = subprocess.run(["mpiname"], capture_output=True, text=True, timeout=30, check=False)
        return "MVAPICH2-GDR" in found.stdout

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        exports = [word for k, v in self.exports.items() for word in ("-env", k, v)]
        return ["mpirun", "-np", str(self._world()), "-ppn", str(self._per_node()),
                "-hosts", ",".join(self.resource_pool), *self._launcher_args(), *exports,
                *self._python(), self.user_script, *self.user_arguments]


class SlurmRunner(_PoolRunner):
    """``srun`` inside an allocation: ``--include``/``--exclude`` pick nodes, ``--num_nodes`` and
    ``--num_gpus`` become ``--nodes`` and ``--gpus``."""

    name = "slurm"  # type: ignore[assignment]

    def backend_exists(self) -> bool:
        return shutil.which("sinfo") is not None

    def validate_args(self) -> None:
        for flag in ("include", "exclude"):
            picked = parse_filter(getattr(self.args, flag), f"--{flag}") if getattr(self.args, flag) else {}
            if any(slots is not None for slots in picked.values()):
                raise UsageError(f"--{flag} {getattr(self.args, flag)!r}: srun picks nodes, not slots; "
                                 "name hosts only")

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        a = self.args
        cmd = ["srun", "-n", str(self._world()), *self._launcher_args()]
        if getattr(a, "slurm_comment", ""):
            cmd += ["--comment", a.slurm_comment]
        if a.include:
            cmd += ["--nodelist", ",".join(parse_filter(a.include, "--include"))]
        if a.exclude:
            cmd += ["--exclude", ",".join(parse_filter(a.exclude, "--exclude"))]
        cmd += ["--nodes", str(a.num_nodes)] if a.num_nodes > 0 else []
        cmd += ["--gpus", str(a.num_gpus)] if a.num_gpus > 0 else []
        exports = ",".join(["--export=ALL", *(f"{k}={v}" for k, v in self.exports.items())])
        return [*cmd, exports, *self._python(), self.user_script, *self.user_arguments]


def _counts(pool: Resources) -> dict[str, int]:
    """``{host: slot count}`` from counts (a hostfile) or slot lists (a filtered pool)."""
    return {h: s if isinstance(s, int) else len(s) for h, s in pool.items()}


def _as_include(pool: Resources) -> str:
    """The pool as an ``--include`` expression (a count means all of the host's slots)."""
    return "@".join(h if isinstance(s, int) else f"{h}:{','.join(map(str, s))}" for h, s in pool.items())
