"""Process-group setup: backend from the hardware, timeout always explicit, env contract.

The launcher exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT to every worker.
A script started by ``srun`` directly (one task per GPU, no launcher) gets them from SLURM's
variables instead (``slurm_env``), one started by a site's own ``mpirun``/``mpiexec`` from its
MPI's (``mpi_env``: Open MPI, MPICH and Intel MPI's Hydra, MVAPICH2); a script started by none of
them runs as a world of one.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import UsageError, quote
from dslaunch.runtime import heartbeat, preempt
from dslaunch.runtime.config import MAX_TIMEOUT_S
from dslaunch.runtime.config.param_schema import number
from dslaunch.runtime.shutdown import register_clean_exit
from dslaunch.utils.hostlist import expand
from dslaunch.utils.ports import free_port
from dslaunch.utils.restart import RENDEZVOUS_ID

__all__ = ["init_distributed", "job_store", "default_timeout", "local_rank", "device_for", "slurm_env", "mpi_env",
           "discovered_env", "mpi_discovery"]

TIMEOUT_ENV = "DSLAUNCH_DIST_TIMEOUT"
_DEFAULT_TIMEOUT_S = 1800.0  # DeepSpeed's default; passed explicitly so every backend honours it


def default_timeout(config_seconds: float | None = None) -> datetime.timedelta:
    """The collective timeout: $DSLAUNCH_DIST_TIMEOUT (seconds), else the config's, else 30 min."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds <= MAX_TIMEOUT_S:  # timedelta overflows far below inf
            raise UsageError(f"{TIMEOUT_ENV}={quote(raw)} is not a number of seconds > 0 (at most {MAX_TIMEOUT_S:g})")
        return datetime.timedelta(seconds=seconds)
    return datetime.timedelta(seconds=config_seconds or _DEFAULT_TIMEOUT_S)


def _config_timeout(config: Any) -> float | None:
    """``dist_init_timeout`` of a ``DeepSpeedConfig`` or of a ds_config dict, if it sets one.

    Raises:
        ConfigError: the dict's value is not a number of seconds > 0.
    """
    if isinstance(config, Mapping):  # initialize(config=...) takes a dict too; users pass it on
        raw = config.get("dist_init_timeout")
        return None if raw is None else number(0.0, MAX_TIMEOUT_S, low_open=True)("dist_init_timeout", raw)
    return getattr(config, "dist_init_timeout", None)


_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 10000, 20000  # below Linux's ephemeral ports (32768-60999)


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables for a task ``srun`` started directly, from SLURM's; {} otherwise.

    Only inside a job step (``SLURM_STEP_ID`` set: the batch script itself is not one of the
    ranks) and only when no launcher set ``RANK``. ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` =
    ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``; ``MASTER_ADDR`` = the step's first node
    (where task 0 runs; the allocation's first node is not in a step started with ``-w``);
    ``MASTER_PORT`` = one derived from ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``, so the job's
    ranks agree on it without talking. Values already in ``env`` win.

    Raises:
        HostfileError: an unreadable ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST`` (named).
    """
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return {}
    source = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    job, step = (int(env.get(k, "0")) if env.get(k, "0").isdigit() else 0 for k in ("SLURM_JOB_ID", "SLURM_STEP_ID"))
    found = {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
             "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
             "MASTER_PORT": str(_SLURM_PORT_BASE + (job * 64 + step) % _SLURM_PORT_SPAN)}
    if env.get(source):
        found["MASTER_ADDR"] = expand(env[source], source)[0]
    return {k: v for k, v in found.items() if k not in env}


_MPI_FLAVOURS = (  # (name, rank, size, local rank, local size): what each MPI's launcher exports
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def mpi_env(env: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables for a process an MPI launcher started directly, from its MPI's
    variables; {} when a launcher set ``RANK`` or no MPI started this process.

    DeepSpeed asks mpi4py (``mpi_discovery``); the launchers' variables say the same without
    initialising MPI in every rank. ``MASTER_ADDR``: kept when set (``mpirun -x MASTER_ADDR=...``),
    127.0.0.1 when every rank runs on this host; across hosts without it, rank 0's address comes
    from mpi4py when installed (``mpi_discovery``), else one line says what to set.

    Raises:
        UsageError: the ranks span hosts, ``MASTER_ADDR`` is unset and mpi4py is not installed.
    """
    if "RANK" in env:
        return {}
    flavour = next((f for f in _MPI_FLAVOURS if f[1] in env and f[2] in env), None)
    if flavour is None:
        return {}
    name, rank, size, local, local_size = flavour
    found = {"RANK": env[rank], "WORLD_SIZE": env[size], "LOCAL_RANK": env.get(local, "0")}
    if "MASTER_ADDR" not in env:
        if env.get(local_size) == env[size]:
            found["MASTER_ADDR"] = "127.0.0.1"
        else:
            found["MASTER_ADDR"] = _rank0_address(name)
    return found


def _rank0_address(flavour: str) -> str:
    try:
        from mpi4py import MPI
    except ImportError:
        raise UsageError(f"started by {flavour}'s launcher on several hosts, but MASTER_ADDR is not set: pass "
                         "rank 0's host (mpirun -x MASTER_ADDR=<host>, or export it in the job script), or "
                         "install mpi4py so the ranks can ask each other") from None
    import socket

    return MPI.COMM_WORLD.bcast(socket.gethostbyname(socket.gethostname()), root=0)


def discovered_env(env: Mapping[str, str], mpi: bool = True) -> dict[str, str]:
    """The launcher's variables from whatever started this process without one: SLURM's ``srun``,
    else (with ``mpi``: DeepSpeed's ``auto_mpi_discovery``) an MPI launcher."""
    return slurm_env(env) or (mpi_env(env) if mpi else {})


def mpi_discovery(distributed_port: int = 29500, verbose: bool = True) -> None:
    """DeepSpeed's ``deepspeed.comm.mpi_discovery``: set RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT for a process an MPI launcher started (``mpi_env``).

    Raises:
        UsageError: no MPI launcher's variables in the environment, or ``mpi_env``'s reason.
    """
    found = mpi_env({k: v for k, v in os.environ.items() if k != "RANK"})
    if not found:
        raise UsageError("mpi_discovery(): this process was not started by mpirun/mpiexec (no OMPI_COMM_WORLD_RANK, "
                         "PMI_RANK or MV2_COMM_WORLD_RANK); start it with the deepspeed/dslaunch command or mpirun")
    os.environ.update({**found, "MASTER_PORT": str(distributed_port)})
    if verbose and found["RANK"] == "0":
        print(f"[dslaunch] mpi_discovery: world_size={found['WORLD_SIZE']} master_addr={os.environ['MASTER_ADDR']} "
              f"master_port={distributed_port}", flush=True)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device_for(rank: int) -> torch.device:
    """cuda:<local rank> with GPUs, else cpu.

    Raises:
        UsageError: more local ranks than visible GPUs (CUDA's own error says "invalid device
            ordinal" from deep inside the first allocation).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UsageError(f"LOCAL_RANK={rank} but this process sees {count} GPU{'s' if count != 1 else ''}"
                         f"{f' (CUDA_VISIBLE_DEVICES={quote(visible)})' if visible is not None else ''}: "
                         "start at most one rank per GPU, or choose the gloo backend for CPU ranks")
    return torch.device("cuda", rank)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise torch.distributed as DeepSpeed's ``init_distributed`` does (same signature).

    Backend: ``nccl`` with GPUs, ``gloo`` without (or ``dist_backend``). Rank and world size come
    from the arguments, else RANK/WORLD_SIZE (from ``srun``'s or, with ``auto_mpi_discovery``, an
    MPI launcher's variables when no launcher set them); without them the job is a world of one,
    met in an in-process store unless MASTER_PORT is set (no port to lose to another process).
    Timeout: ``timeout``, else $DSLAUNCH_DIST_TIMEOUT, else ``dist_init_timeout`` of
    ``config`` (a ``DeepSpeedConfig`` or a ds_config dict), else 30 minutes.

    Raises:
        UsageError: $DSLAUNCH_DIST_TIMEOUT is not a number of seconds.
        ConfigError: a dict ``config`` has an invalid ``dist_init_timeout``.

    collective: call on all ranks. A no-op when already initialised (unless
    ``dist_init_required`` is False, which always skips).
    """
    if dist_init_required is False:
        return
    register_clean_exit()  # also for a group the script made itself: it must die before Python
    preempt.arm()  # before the first beat, which tells the agent this rank takes requests
    heartbeat.start()  # the rank is up, and its stacks can be dumped while it waits for its peers
    if dist.is_initialized():
        return
    os.environ.update(discovered_env(os.environ, auto_mpi_discovery))  # the script may read them too
    rank = rank if rank >= 0 else int(os.environ.get("RANK", "0"))
    world_size = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
    store = None
    if init_method is None:
        if world_size == 1 and "MASTER_PORT" not in os.environ:
            # No peer to meet: an in-process store listens on no port, so no other process can take
            # it between the draw and the bind. MASTER_PORT is still set for scripts that read it.
            store = dist.HashStore()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port if world_size > 1 else free_port()))
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(device_for(local_rank()))
    timeout = timeout or default_timeout(_config_timeout(config))
    if store is None and init_method is None and world_size > 1 and os.environ.get(RENDEZVOUS_ID):
        store = job_store(rank, world_size, timeout)
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    if verbose and rank == 0:
        print(f"[dslaunch] initialized {backend} process group: world_size={world_size}, "
              f"timeout={timeout.total_seconds():.0f}s", flush=True)


_JOB_KEY = "dslaunch/job"


def job_store(rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """env://'s TCPStore at MASTER_ADDR:MASTER_PORT, checked to be this run's of this job.

    Two jobs on one port (two launches at once, the same ``--master_port``) would otherwise meet in
    one world: ranks of one job joining the other's store, computing on wrong data and exiting 0.
    Rank 0 writes ``$DSLAUNCH_RENDEZVOUS_ID`` (the job's id and run, set where one controller
    started every node; a straggler of the last run is another job too); every other rank reads it
    back before any group is made.

    Raises:
        UsageError: the port is another process's, or the store there is another job's.

    collective: call on all ranks of the job.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    ours = os.environ[RENDEZVOUS_ID]
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    except dist.DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
        raise UsageError(f"MASTER_PORT {port} is already in use on this host (another job's rendezvous?): "
                         "give each job its own --master_port") from None
    if rank == 0:
        store.set(_JOB_KEY, ours)
        return store
    theirs = store.get(_JOB_KEY).decode(errors="replace")
    if theirs != ours:
        raise UsageError(f"{addr}:{port} is the rendezvous of another dslaunch job ({quote(theirs, 80)}), not of "
                         f"this one ({ours}): two jobs share the port; give each its own --master_port")
    return store

