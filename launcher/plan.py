"""From launcher options to a ``JobSpec``: which hosts, which slots, which ranks, which env.

``LaunchConfig`` is the typed form of the command line (built by ``cli.py``); ``build_job``
resolves it against the hostfile (or localhost and its accelerators) into the frozen
``JobSpec`` runners consume. All user mistakes surface here as typed errors, before anything runs.

Rank layout follows DeepSpeed: nodes in hostfile order, global ranks consecutive per node,
``CUDA_VISIBLE_DEVICES`` = the node's selected slots, ``--local_rank=N`` right after the script.
With ``--no_ssh`` every node plans the whole job the same way and keeps only its own node.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from dslaunch.errors import HostfileError, UsageError, quote, shorten
from dslaunch.launcher.gpus import Accelerators
from dslaunch.launcher.hostfile import (
    MAX_SLOTS,
    MAX_WORLD,
    Pool,
    apply_filter,
    ascii_int,
    hostname_problem,
    read_hostfile,
)
from dslaunch.launcher.kubernetes import Pod
from dslaunch.launcher.runners.ray.cluster import RayCluster, ray_pool
from dslaunch.launcher.runners.slurm.allocation import Allocation, slurm_pool
from dslaunch.launcher.spec import DEFAULT_GRACE, JobSpec, MonitorSpec, NodeSpec, WorkerSpec
from dslaunch.launcher.workerenv import node_env, worker_env
from dslaunch.utils.beat import MAX_HANG_TIMEOUT, MIN_HANG_TIMEOUT
from dslaunch.utils.restart import restart_env

__all__ = ["LaunchConfig", "Plan", "build_job", "check_numbers", "elastic_batch_for", "ds_config_path", "LOCAL_HOSTS",
           "DEFAULT_HOSTFILE",
           "PID_FILE_DIR", "MAX_GRACE", "LOG_DIR_ENV", "default_log_dir", "MAX_HANG_TIMEOUT", "job_id"]

DEFAULT_HOSTFILE = "/job/hostfile"
LOCAL_HOSTS = ("localhost", "127.0.0.1")
PID_FILE_DIR = "/tmp"
"""``--save_pid`` writes ``PID_FILE_DIR/<controller pid>.deepspeed`` (DeepSpeed's path)."""
# An hour is far beyond any clean shutdown; inf would kill the stop timer (OverflowError).
MAX_GRACE = 3600.0
LOG_DIR_ENV = "DSLAUNCH_LOG_DIR"
"""Environment variable naming the default ``--log_dir`` (the flag and ``monitor.log_dir`` win)."""


def default_log_dir(env: Mapping[str, str] | None = None) -> str:
    """``--log_dir``'s default, an absolute path: ``$DSLAUNCH_LOG_DIR``, else the per-user XDG state
    directory ``$XDG_STATE_HOME/dslaunch/logs`` (``~/.local/state/dslaunch/logs`` when that is
    unset or relative, as the XDG spec says). Never the working directory: a job started in a
    script's folder leaves nothing there. Each job writes into ``<log_dir>/<job id>``."""
    env = os.environ if env is None else env
    if env.get(LOG_DIR_ENV):
        return os.path.abspath(env[LOG_DIR_ENV])
    state = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        state = os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "dslaunch", "logs")


@dataclass(frozen=True)
class LaunchConfig:
    """The launcher's command line, typed. Defaults match DeepSpeed's ``deepspeed`` command."""

    user_script: str
    user_args: tuple[str, ...] = ()
    hostfile: str = DEFAULT_HOSTFILE
    hostfile_explicit: bool = False
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    master_addr: str = ""
    master_port: int = 29500
    launcher: str = ""
    """Empty = automatic: ``ssh`` when any host is remote or ``force_multi``, else ``local``."""
    launcher_args: str = ""
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    force_multi: bool = False
    save_pid: bool = False
    each_rank_log: str | None = None
    bind_cores_to_rank: bool = False
    bind_core_list: tuple[int, ...] = ()
    ssh_port: int | None = None
    ssh_accept_new_host_keys: bool = False
    venv_script: str | None = None
    """``--venv_script``: sourced by each SSH host's shell before its agent starts."""
    log_level: str = "info"
    """``--log_level`` (``-q``: error): which of the launcher's own lines are printed (``log_level``)."""
    grace: float = DEFAULT_GRACE
    no_ssh: bool = False
    """``--no_ssh``: this process starts only node ``node_rank``'s workers, here; every node runs
    the same command with its own ``--node_rank`` (no SSH between nodes)."""
    node_rank: int = -1
    """``--node_rank``: with ``no_ssh``, this node's index among the selected hosts (-1 = unset)."""
    hang_timeout: float | None = None
    """``--hang_timeout``: seconds without progress before a rank counts as hung; None = off."""
    log_dir: str | None = None
    """``--log_dir``: base directory of the job's events, error files and stacks (None = default)."""
    visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` of the launching environment (None = unset). Without a hostfile it
    picks the local GPUs, as DeepSpeed turns it into ``--include localhost:<devices>``."""
    master_port_given: bool = False
    """``--master_port`` was on the command line: every run uses it (else restarts pick a free one)."""
    max_restarts: int = 0
    warm_spares: bool = True
    """Restarted local workers run in spare interpreters kept warm (``launcher.agent.spare``)."""
    restart_count: int = 0
    """Which run this plan is for (0 = the first; set by the job loop, told to the workers)."""
    restart_reason: str | None = None
    """Why this run is a restart (the job loop's decision, told to the workers); None in the first run."""
    resume_from: str | None = None
    """``--resume_from``: checkpoint directory a restarted run's ``initialize()`` loads."""
    job_id: str = ""
    """The job's id, the same in every run (its log directory's name; the workers' ``DSLAUNCH_JOB_ID``,
    which names the job's in-memory checkpoints); "" = made when the job is planned."""
    drop_hosts: tuple[str, ...] = ()
    """Hosts left out of this run (lost hosts of an elastic job), after include/exclude."""
    max_nodes: int = 0
    """``--max_elastic_nodes`` of an elastic job: use at most this many hosts (0 = no limit)."""
    pod: Pod | None = None
    """The Kubernetes pod this node runs in (``launcher.kubernetes``; None elsewhere): with it, the job's
    nodes are its pods and this one is ``no_ssh`` node ``node_rank``."""
    allocation: Allocation | None = None
    """The SLURM allocation the launcher runs in (None outside SLURM): without a ``--hostfile``
    its nodes are the hosts and the job runs through ``srun`` (``--launcher slurm``)."""
    ray: RayCluster | None = None
    """``--launcher ray``: the Ray cluster joined (or started) for the job; its nodes are the hosts."""
    world_info: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """DeepSpeed's ``launch.py --world_info`` (``launcher.launch``): the hosts and their slots, given
    instead of a hostfile (empty = none given)."""


@dataclass(frozen=True)
class Plan:
    """A resolved job plus what the user should be told about how it was resolved."""

    job: JobSpec
    notes: tuple[str, ...] = ()


def build_job(cfg: LaunchConfig, detect: Callable[[], Accelerators]) -> Plan:
    """Resolve ``cfg`` into a job.

    Args:
        cfg: the command line.
        detect: returns local accelerators; only called when no hostfile is used.

    Raises:
        HostfileError: bad hostfile or include/exclude.
        UsageError: inconsistent flags (e.g. more GPUs than slots).
    """
    check_numbers(cfg)
    if not cfg.job_id:
        cfg = replace(cfg, job_id=job_id())
    slurm = _uses_slurm(cfg)
    if slurm and cfg.allocation.requeues:  # a requeued SLURM job is a restart of the job
        cfg = replace(cfg, restart_count=cfg.restart_count + cfg.allocation.requeues)
    notes: list[str] = _resume_notes(cfg)
    # Under SLURM --num_gpus is the workers per node and include/exclude pick nodes: no overlap.
    if (cfg.include or cfg.exclude) and (cfg.num_nodes > 0 or cfg.num_gpus > 0 and not (slurm or cfg.ray)):
        raise UsageError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    given = slurm or cfg.pod or cfg.ray or cfg.world_info
    hosts = None if given else read_hostfile(cfg.hostfile, cfg.hostfile_explicit)
    source = ("SLURM_JOB_NODELIST" if slurm else "PET_NNODES" if cfg.pod else f"Ray cluster {cfg.ray.address}"
              if cfg.ray else "--world_info" if cfg.world_info else cfg.hostfile if hosts is not None else None)
    if cfg.world_info:  # slots are GPUs, as in a hostfile
        pool, use_gpus = dict(cfg.world_info), True
    elif cfg.ray:
        # As under SLURM, Ray gives each node's actor its GPUs: the plan leaves CUDA_VISIBLE_DEVICES alone.
        pool, use_gpus = ray_pool(cfg.ray, cfg.include, cfg.exclude, cfg.num_gpus, notes), False
    elif cfg.pod:
        pool, use_gpus = _pod_pool(cfg, cfg.pod, detect)
    elif slurm:
        # SLURM gives the step its own CUDA_VISIBLE_DEVICES: the plan leaves it alone.
        pool, use_gpus = slurm_pool(cfg.allocation, cfg.include, cfg.exclude, cfg.num_gpus, notes), False
    elif hosts is None:
        pool, use_gpus = _localhost(cfg, detect, notes)
    else:
        pool, use_gpus = apply_filter(hosts, cfg.include, cfg.exclude), True  # slots are GPUs (DeepSpeed)
    pool = {h: s for h, s in _limit(pool, cfg, source).items() if h not in cfg.drop_hosts}
    if cfg.max_nodes and len(pool) > cfg.max_nodes:
        pool = dict(list(pool.items())[:cfg.max_nodes])
    if not pool:
        raise HostfileError(f"no host left: every selected host was lost ({', '.join(cfg.drop_hosts)})", source)
    _check_no_ssh(cfg, pool)
    launcher = "slurm" if slurm else _launcher(cfg, pool)
    if cfg.venv_script and launcher != "ssh":  # DeepSpeed's PDSH runner alone sources it; said, not silent
        notes.append(f"--venv_script {cfg.venv_script} is sourced by the ssh launcher only: not used by this "
                     f"{launcher} launch (activate the environment before running dslaunch)")
    first = next(iter(pool))
    master_addr = cfg.master_addr or ("127.0.0.1" if launcher == "local" else cfg.ray.node(first).address
                                      if cfg.ray else first)
    world = sum(len(s) for s in pool.values())
    nodes, rank = [], 0
    for node_rank, (host, slots) in enumerate(pool.items()):
        nodes.append(_node(cfg, node_rank, host, slots, rank, world, len(pool), master_addr, use_gpus, slurm))
        rank += len(slots)
    if cfg.no_ssh:  # every node plans the whole job (same ranks everywhere), then starts only its own
        nodes = [nodes[cfg.node_rank]]
        notes.append(_no_ssh_note(nodes[0], len(pool), world, cfg.pod, "--world_info" if cfg.world_info else "--no_ssh"))
    if launcher == "local" and len(nodes) > 1:  # checked here so that --dry-run fails like a real run
        raise UsageError(f"the local launcher runs one node, but {len(nodes)} hosts are selected "
                         f"({', '.join(n.host for n in nodes)}); use --launcher ssh, or select one host "
                         "(--include, --num_nodes 1)")
    job = JobSpec(
        nodes=tuple(nodes), master_addr=master_addr, master_port=cfg.master_port, world_size=world,
        launcher=launcher, launcher_args=cfg.launcher_args, python=sys.executable,
        ssh_port=cfg.ssh_port, ssh_accept_new_host_keys=cfg.ssh_accept_new_host_keys,
        venv_script=cfg.venv_script, log_level=cfg.log_level, hostfile=source, user_script=None if cfg.module or cfg.no_python else cfg.user_script,
        master_given=bool(cfg.master_addr), monitor=_monitor(cfg), ray_address=cfg.ray.address if cfg.ray else None,
    )
    return Plan(job, tuple(notes))


def job_id() -> str:
    """A name for this run of the launcher, unique on this host: ``20261124-013512-4242-9f3a1c``.

    Sorted by time; the random tail makes it unguessable, because the job's directory must be new
    and a name another user could predict (time and pid) could be planted first in a shared
    ``--log_dir`` such as ``/tmp``, stopping the job."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"


def _monitor(cfg: LaunchConfig) -> MonitorSpec:
    base = os.path.abspath(cfg.log_dir or default_log_dir())
    suffix = f"-node{cfg.node_rank}" if cfg.no_ssh else ""  # every node runs its own controller
    return MonitorSpec(hang_timeout=cfg.hang_timeout, log_dir=os.path.join(base, (cfg.job_id or job_id()) + suffix))


def _localhost(cfg: LaunchConfig, detect: Callable[[], Accelerators], notes: list[str]) -> tuple[Pool, bool]:
    """No hostfile: localhost with its GPUs, or ``--num_gpus`` CPU workers."""
    acc = detect()
    if acc.kind == "cuda" and cfg.visible_devices != "":
        return _local_gpus(cfg, acc.count, notes), True
    reason = acc.reason if acc.kind == "cpu" else "CUDA_VISIBLE_DEVICES is set and empty"
    if cfg.num_gpus > 0:
        what = "1 CPU worker process" if cfg.num_gpus == 1 else f"{cfg.num_gpus} CPU worker processes"
        notes.append(f"no GPU ({reason}): starting {what} (use the gloo backend)")
        count = cfg.num_gpus
    else:
        notes.append(f"no GPU ({reason}) and no --num_gpus: starting 1 CPU worker process")
        count = 1
    return apply_filter({"localhost": count}, cfg.include, cfg.exclude), False


def _pod_pool(cfg: LaunchConfig, pod: Pod, detect: Callable[[], Accelerators]) -> tuple[Pool, bool]:
    """Every pod of the job with this pod's workers: ``PET_NPROC_PER_NODE``, else its GPUs, else
    ``--num_gpus`` CPU workers, else one (every pod of a job has the same shape)."""
    acc = detect()
    gpus = acc.kind == "cuda" and cfg.visible_devices != ""
    count = pod.nproc_per_node or (acc.count if gpus else max(cfg.num_gpus, 1))
    return {h: tuple(range(count)) for h in pod.hosts()}, gpus


def _uses_slurm(cfg: LaunchConfig) -> bool:
    """``--launcher slurm``, or automatic: inside an allocation without ``--hostfile``/``--no_ssh``."""
    if cfg.launcher == "slurm":
        if cfg.allocation is None:
            raise UsageError("--launcher slurm runs inside a SLURM allocation, but SLURM_JOB_ID is not set: "
                             "run it in sbatch or salloc, or submit with 'dslaunch sbatch'")
        if cfg.no_ssh:
            raise UsageError("--no_ssh starts this node's workers here, without a launcher; "
                             "leave out --launcher slurm")
        return True
    return cfg.launcher == "" and cfg.allocation is not None and not cfg.hostfile_explicit and not cfg.no_ssh


def _local_gpus(cfg: LaunchConfig, count: int, notes: list[str]) -> Pool:
    """This machine's GPUs: those ``CUDA_VISIBLE_DEVICES`` lists (in its order), else all."""
    visible = cfg.visible_devices
    if visible is not None and (cfg.include or cfg.exclude):
        # As DeepSpeed: the explicit flag wins (the variable usually comes from the shell profile).
        notes.append(f"CUDA_VISIBLE_DEVICES={visible} ignored: --include/--exclude choose the GPUs")
        visible = None
    if visible is None:
        if cfg.num_gpus > count:
            raise UsageError(f"--num_gpus {cfg.num_gpus}: this machine has {count} GPUs")
        return apply_filter({"localhost": count}, cfg.include, cfg.exclude)
    slots = _visible_slots(visible, count)
    if cfg.num_gpus > len(slots):
        raise UsageError(f"--num_gpus {cfg.num_gpus}: CUDA_VISIBLE_DEVICES={visible} lists {len(slots)} GPUs")
    notes.append(f"CUDA_VISIBLE_DEVICES={visible}: using GPUs {','.join(map(str, slots))}")
    return {"localhost": slots}


def _visible_slots(text: str, count: int) -> tuple[int, ...]:
    """``CUDA_VISIBLE_DEVICES='1,3'`` -> (1, 3), checked against the ``count`` GPUs NVML reports."""
    where = f"CUDA_VISIBLE_DEVICES={text!r}"
    slots: list[int] = []
    for part in text.split(","):
        n = ascii_int(part.strip())
        if n is None or n < 0:
            raise UsageError(f"{where}: {part!r} is not a GPU index; dslaunch reads indices like '0,2' "
                             "(unset it, or choose GPUs with --include localhost:0,2)")
        if n >= count:
            raise UsageError(f"{where}: there is no GPU {n}; NVML reports {count} GPUs (0-{count - 1})")
        if n in slots:
            raise UsageError(f"{where}: GPU {n} is listed twice")
        slots.append(n)
    return tuple(slots)


def _limit(pool: Pool, cfg: LaunchConfig, hostfile: str | None) -> Pool:
    """Apply ``--num_nodes`` (first N hosts) and ``--num_gpus`` (first N slots of each host)."""
    if cfg.num_nodes > 0:
        if cfg.num_nodes > len(pool):
            raise HostfileError(f"--num_nodes {cfg.num_nodes}: only {len(pool)} hosts available", hostfile)
        pool = dict(list(pool.items())[:cfg.num_nodes])
    if cfg.num_gpus > 0:
        short = [h for h, s in pool.items() if len(s) < cfg.num_gpus]
        if short:
            raise HostfileError(f"--num_gpus {cfg.num_gpus}: host {short[0]!r} has only "
                                f"{len(pool[short[0]])} slots", hostfile)
        pool = {h: s[:cfg.num_gpus] for h, s in pool.items()}
    return pool


def _launcher(cfg: LaunchConfig, pool: Pool) -> str:
    """The runner: ``--launcher``, else ssh when a host is remote (or --force_multi), else local."""
    if cfg.no_ssh:
        if cfg.launcher not in ("", "local"):
            raise UsageError(f"--no_ssh starts this node's workers here, without a launcher; "
                             f"leave out --launcher {cfg.launcher}")
        return "local"
    return cfg.launcher or ("ssh" if cfg.force_multi or any(h.lower() not in LOCAL_HOSTS for h in pool) else "local")


def _check_no_ssh(cfg: LaunchConfig, pool: Pool) -> None:
    """``--no_ssh`` needs this node's ``--node_rank`` and an address of node 0 every node can reach."""
    if not cfg.no_ssh:
        if cfg.node_rank != -1:
            raise UsageError(f"--node_rank {cfg.node_rank} is only used with --no_ssh (each node then "
                             "starts its own workers)")
        return
    valid = f"valid: {'0' if len(pool) == 1 else f'0-{len(pool) - 1}'}, the selected hosts in hostfile order"
    if cfg.node_rank == -1:
        raise UsageError(f"--no_ssh needs --node_rank N, this node's index ({valid})")
    if not 0 <= cfg.node_rank < len(pool):
        raise UsageError(f"--node_rank {cfg.node_rank} is out of range ({valid})")
    if not cfg.master_addr:
        raise UsageError(f"--no_ssh needs --master_addr: the address of node 0 ({next(iter(pool))}), "
                         "reachable from every node")


def _no_ssh_note(node: NodeSpec, num_nodes: int, world: int, pod: Pod | None, how: str) -> str:
    first, last = node.workers[0].global_rank, node.workers[-1].global_rank
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    if pod is not None:
        return (f"Kubernetes pod {node.node_rank} of {num_nodes} (PET_* variables): {ranks} of {world} here, "
                f"node 0 at {pod.master_addr}")
    return (f"{how}: starting node {node.node_rank} of {num_nodes} ({node.host}: {ranks} of {world}) "
            "here; start each other node the same way with its own --node_rank")


def check_numbers(cfg: LaunchConfig) -> None:
    """Every number of the command line in a finite range, each error naming its flag."""
    _check_count("--num_nodes", cfg.num_nodes, MAX_WORLD, "hosts")
    _check_count("--num_gpus", cfg.num_gpus, MAX_SLOTS, "workers per host")
    for flag, port in (("--master_port", cfg.master_port), ("--ssh_port", cfg.ssh_port)):
        if port is not None and not 0 < port < 65536:
            raise UsageError(f"{flag} {port} is not a TCP port (1-65535)")
    if not (math.isfinite(cfg.grace) and 0 <= cfg.grace <= MAX_GRACE):  # nan fails every comparison
        raise UsageError(f"--grace_period {cfg.grace:g}: expected seconds from 0 to {MAX_GRACE:g}")
    t = cfg.hang_timeout
    if t is not None and not (math.isfinite(t) and MIN_HANG_TIMEOUT <= t <= MAX_HANG_TIMEOUT):
        raise UsageError(f"--hang_timeout {t:g}: expected seconds from {MIN_HANG_TIMEOUT:g} (heartbeats reach "
                         f"the launcher up to 1 s late) to {MAX_HANG_TIMEOUT:g} (leave the flag out to turn "
                         "hang detection off)")
    if cfg.log_dir == "" or (cfg.log_dir and "\0" in cfg.log_dir):
        raise UsageError(f"--log_dir {quote(cfg.log_dir)}: not a path (empty, or a NUL character); give a "
                         f"directory, or leave the flag out for {default_log_dir()}")
    if cfg.master_addr and (problem := hostname_problem(cfg.master_addr)):
        raise UsageError(f"--master_addr {quote(cfg.master_addr)}: {problem}")


def _resume_notes(cfg: LaunchConfig) -> list[str]:
    """``--resume_from`` must be a directory or a path where one can be made: a file (or a path
    under one) would leave every restart starting from scratch, silently. One that does not exist
    yet is valid (the first run of a requeued job has nothing to resume) and gets a note.

    Raises:
        UsageError: an empty path, a file, or a path under a file.
    """
    path = cfg.resume_from
    if path is None:
        return []
    flag = f"--resume_from '{shorten(path, 200)}'"
    if not path:
        raise UsageError("--resume_from '': empty path; give the checkpoint directory restarts load from, "
                         "or leave the flag out")
    parent = path
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.exists(parent) and not os.path.isdir(parent):
        what = "is a file" if parent == path else f"is under the file '{shorten(parent, 200)}'"
        raise UsageError(f"{flag} {what}; expected the checkpoint directory restarts load from (the one "
                         "the script saves into), existing or not")
    if parent != path and cfg.restart_count == 0:
        return [f"{flag} does not exist yet: this run starts at step 0; a restart resumes from the newest "
                "checkpoint saved there"]
    return []


def _check_count(flag: str, n: int, most: int, what: str) -> None:
    """-1 is DeepSpeed's default for both flags: all hosts / all slots. Other values: 1 to ``most``."""
    if not (n == -1 or 0 < n <= most):
        raise UsageError(f"{flag} {n}: expected 1 to {most} {what} (or -1, the default: all)")


def _node(cfg: LaunchConfig, node_rank: int, host: str, slots: tuple[int, ...], first_rank: int,
          world: int, num_nodes: int, master_addr: str, use_gpus: bool, slurm: bool) -> NodeSpec:
    workers = tuple(WorkerSpec(first_rank + i, i, _argv(cfg, i), worker_env(first_rank + i, i))
                    for i in range(len(slots)))
    return NodeSpec(
        node_rank=node_rank, host=host, workers=workers, cwd=os.getcwd(),
        env={**node_env(master_addr, cfg.master_port, world, node_rank, num_nodes, slots, use_gpus),
             # Under SLURM the ranks checkpoint into --resume_from on the time-limit warning.
             **restart_env(cfg.restart_count, cfg.max_restarts, cfg.resume_from, on_request=slurm,
                           reason=cfg.restart_reason, job=cfg.job_id, every_node=not cfg.no_ssh)},
        log_dir=os.path.abspath(cfg.each_rank_log) if cfg.each_rank_log else None, grace=cfg.grace,
        pid_file=os.path.join(PID_FILE_DIR, f"{os.getpid()}.deepspeed") if cfg.save_pid else None,
        bind_cores=cfg.bind_cores_to_rank, core_list=cfg.bind_core_list,
    )


def _argv(cfg: LaunchConfig, local_rank: int) -> tuple[str, ...]:
    if cfg.no_python:
        head: tuple[str, ...] = (cfg.user_script,)
    elif cfg.module:
        head = (sys.executable, "-u", "-m", cfg.user_script)
    else:
        head = (sys.executable, "-u", cfg.user_script)
    local = () if cfg.no_local_rank else (f"--local_rank={local_rank}",)
    return head + local + cfg.user_args


def elastic_batch_for(cfg: LaunchConfig, world: int) -> str | None:
    """The batch an elastic job's new world size gets, checked before the run starts.

    Reads the ds_config named by ``--deepspeed_config`` in the script's arguments; with an enabled
    ``elasticity`` block, returns e.g. ``train_batch_size 1680 = 6 x 280 x 1`` (micro x accumulation x
    world), else None. Torch-free, like the config code it calls.

    Raises:
        ConfigError: no valid batch for ``world`` (the message names the constraint), or a bad config.
    """
    path = ds_config_path(cfg.user_args)
    if path is None:
        return None
    from pathlib import Path

    from dslaunch.runtime.config.elasticity import ElasticityConfig, elastic_batch
    from dslaunch.runtime.config.file import read_config_file
    from dslaunch.runtime.config.sections import parse_section

    raw = read_config_file(Path(path))
    block = raw.get("elasticity") if isinstance(raw, dict) else None
    elastic = parse_section(ElasticityConfig, block, "elasticity") if block is not None else None
    if elastic is None or not elastic.enabled:
        return None
    b = elastic_batch(elastic, world)
    return (f"train_batch_size {b.train_batch_size} = {b.micro_batch} x {b.gradient_accumulation_steps} x "
            f"{world} (micro batch x accumulation steps x world size)")


def ds_config_path(user_args: tuple[str, ...]) -> str | None:
    """The ds_config the script is given, else None: the path after ``--deepspeed_config`` (or in
    ``--deepspeed_config=PATH``), else Hugging Face's ``--deepspeed PATH.json`` (there a path or
    inline JSON; DeepSpeed's own ``--deepspeed`` takes no value: only a ``.json`` name counts, so a
    script's next argument is never read as a config)."""
    for flag, wanted in (("--deepspeed_config", lambda _: True), ("--deepspeed", _json_name)):
        path = _flag_value(user_args, flag)
        if path is not None and wanted(path):
            return path
    return None


def _json_name(path: str) -> bool:
    return path.lower().endswith(".json")


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``flag VALUE`` or ``flag=VALUE``, the first), else None."""
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None
