"""The launch command: DeepSpeed's launcher flags, then the job.

Usage::

    dslaunch [launcher options] user_script [script args]

A short pipeline: parse flags -> ``LaunchConfig`` -> ``plan.build_job`` -> runner from the
registry -> start, wait, exit with the job's code. Errors are raised for ``cli.main`` to print.

The controller stays lean on purpose (argparse, no torch, no psutil, no paramiko on the local
path): workers start within milliseconds of the command.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import replace

from dslaunch.errors import DslaunchError, UsageError, WorkerFailedError
from dslaunch.launcher import gpus
from dslaunch.launcher.agent.spare import SparePool
from dslaunch.launcher.cli.flags import build_parser
from dslaunch.launcher.kubernetes import pod_from_env
from dslaunch.launcher.log_level import chosen, say
from dslaunch.launcher.monitor.events import EventLog
from dslaunch.launcher.monitor.health import FIRST_STEP_ALLOWANCE_S
from dslaunch.launcher.monitor.loop import Attempt, JobLoop, print_event
from dslaunch.launcher.monitor.memory_store import free_memory_stores
from dslaunch.launcher.monitor.restart import RestartPolicy
from dslaunch.launcher.plan import (
    DEFAULT_HOSTFILE,
    LaunchConfig,
    build_job,
    ds_config_path,
    elastic_batch_for,
    job_id,
)
from dslaunch.launcher.runners import get_runner
from dslaunch.launcher.runners.local import LocalRunner
from dslaunch.launcher.runners.slurm.allocation import from_env as slurm_allocation
from dslaunch.launcher.runners.slurm.preemption import Preemption
from dslaunch.launcher.spec import JobSpec
from dslaunch.utils.ports import free_port
from dslaunch.utils.restart import MAX_RESTARTS

__all__ = ["run", "launch_job", "parse_config", "restart_policy", "check_script"]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def parse_config(argv: list[str],
                 env: Mapping[str, str] | None = None) -> tuple[LaunchConfig, argparse.Namespace]:
    """Parse the command line into a LaunchConfig (and the namespace for CLI-only flags).

    ``env`` is the launching environment (default ``os.environ``): its CUDA_VISIBLE_DEVICES
    selects the local GPUs.

    Raises:
        UsageError: bad flags.
    """
    ns = build_parser().parse_args(argv)
    _apply_monitor_block(ns)
    if ns.module and ns.no_python:
        raise UsageError("--module and --no_python are mutually exclusive")
    if ns.hostfile == "":  # else the default's name would be blamed: "/job/hostfile: not found"
        raise UsageError(f"--hostfile '': empty path; give a hostfile, or leave the flag out to use "
                         f"{DEFAULT_HOSTFILE} (localhost when it does not exist)")
    cfg = LaunchConfig(
        user_script=ns.user_script, user_args=tuple(ns.user_args),
        hostfile=ns.hostfile or DEFAULT_HOSTFILE, hostfile_explicit=ns.hostfile is not None,
        include=ns.include, exclude=ns.exclude, num_nodes=ns.num_nodes, num_gpus=ns.num_gpus,
        master_addr=ns.master_addr, master_port=29500 if ns.master_port is None else ns.master_port,
        master_port_given=ns.master_port is not None, launcher=ns.launcher,
        launcher_args=ns.launcher_args, module=ns.module, no_python=ns.no_python,
        no_local_rank=ns.no_local_rank, force_multi=ns.force_multi, save_pid=ns.save_pid,
        each_rank_log=ns.enable_each_rank_log, bind_cores_to_rank=ns.bind_cores_to_rank,
        bind_core_list=core_list(ns.bind_core_list), ssh_port=ns.ssh_port,
        ssh_accept_new_host_keys=ns.ssh_accept_new_host_keys, venv_script=ns.venv_script, grace=ns.grace_period,
        log_level=chosen(ns.log_level, ns.quiet),
        no_ssh=ns.no_ssh, node_rank=ns.node_rank, hang_timeout=ns.hang_timeout, log_dir=ns.log_dir,
        visible_devices=(os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES"),
        max_restarts=ns.max_restarts, warm_spares=not ns.no_warm_spares,
        # '' stays '' (abspath would make it the cwd) for the plan to refuse
        resume_from=os.path.abspath(ns.resume_from) if ns.resume_from else ns.resume_from,
        max_nodes=ns.max_elastic_nodes if ns.elastic_training and ns.max_elastic_nodes > 0 else 0,
        allocation=slurm_allocation(os.environ if env is None else env), ray=_ray_cluster(ns),
    )
    return _in_pod(cfg, ns, os.environ if env is None else env), ns


def _ray_cluster(ns: argparse.Namespace):  # -> RayCluster | None
    """``--launcher ray``: join the cluster (``--ray_address``) or start a local one; read its nodes.

    Raises:
        UsageError: ``--ray_address`` without ``--launcher ray``, Ray missing, or no cluster there.
    """
    if ns.launcher != "ray":
        if ns.ray_address is not None:
            raise UsageError(f"--ray_address {ns.ray_address} is only used with --launcher ray")
        return None
    if ns.no_ssh or ns.hostfile is not None:
        raise UsageError("--launcher ray runs on the Ray cluster's nodes: leave out "
                         f"{'--no_ssh' if ns.no_ssh else '--hostfile'}")
    from dslaunch.launcher.runners.ray.cluster import connect

    return connect(ns.ray_address)


def _in_pod(cfg: LaunchConfig, ns: argparse.Namespace, env: Mapping[str, str]) -> LaunchConfig:
    """Inside a Kubernetes training job's pod (``launcher.kubernetes``) with no hostfile, launcher or
    ``--no_ssh`` of the user's: this pod is ``--no_ssh`` node ``PET_NODE_RANK``; flags win."""
    if ns.hostfile is not None or ns.launcher or ns.no_ssh or cfg.allocation is not None:
        return cfg
    pod = pod_from_env(env)
    if pod is None:
        return cfg
    port_given = ns.master_port is not None or pod.master_port is not None
    return replace(cfg, pod=pod, no_ssh=True, node_rank=pod.node_rank, master_addr=ns.master_addr or pod.master_addr,
                   master_port=ns.master_port or pod.master_port or cfg.master_port, master_port_given=port_given)


def _apply_monitor_block(ns: argparse.Namespace) -> None:
    """Fill ``--hang_timeout``, ``--max_restarts`` and ``--log_dir`` that the command line left
    out from the ds_config's ``monitor`` block (a flag given always wins), and record where each
    came from for ``--dry-run``. The config is read only when the script is given one that exists
    (a missing one is the workers' to report; a FIFO, a device or a directory is refused here, at
    once); the config code is torch-free and loaded only then.

    Raises:
        ConfigError: an unreadable config, or a bad ``monitor`` block (naming the key).
    """
    path = ds_config_path(tuple(ns.user_args))
    ns.monitor_from = {}
    if path is not None and os.path.exists(path):
        from dslaunch.runtime.config.monitor import monitor_block

        block = monitor_block(path)
        for key in ("hang_timeout", "max_restarts", "log_dir"):
            if getattr(ns, key) is None and getattr(block, key) is not None:
                setattr(ns, key, getattr(block, key))
                ns.monitor_from[key] = path
    if ns.max_restarts is None:
        ns.max_restarts = 0


def restart_policy(ns: argparse.Namespace, requeued_by_slurm: bool = False) -> RestartPolicy:
    """The restart policy the flags ask for (``requeued_by_slurm``: inside a SLURM allocation,
    where a requeue restarts the job and ``--resume_from`` acts without ``--max_restarts``).

    Raises:
        UsageError: elastic flags without ``--elastic_training``, or out of range.
    """
    for flag in ("min_elastic_nodes", "max_elastic_nodes"):
        value = getattr(ns, flag)
        if value != -1 and not ns.elastic_training:
            raise UsageError(f"--{flag} {value} is only used with --elastic_training")
        if value != -1 and value < 1:
            raise UsageError(f"--{flag} {value}: expected 1 or more nodes (or -1, the default)")
    if ns.resume_from and ns.max_restarts == 0 and not requeued_by_slurm:
        raise UsageError(f"--resume_from {ns.resume_from} acts when the job restarts: add --max_restarts N "
                         "(N >= 1), or load the checkpoint in the script (engine.load_checkpoint)")
    if ns.max_restarts > MAX_RESTARTS:
        raise UsageError(f"--max_restarts {ns.max_restarts}: expected 0 to {MAX_RESTARTS}")
    if ns.elastic_training and ns.max_restarts == 0:
        raise UsageError("--elastic_training restarts without a lost host, so it needs a restart budget: "
                         "add --max_restarts N (N >= 1)")
    return RestartPolicy(max_restarts=ns.max_restarts, elastic=ns.elastic_training,
                         min_nodes=max(1, ns.min_elastic_nodes),
                         max_nodes=max(0, ns.max_elastic_nodes))


_CORE_RANGE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")  # 5 digits: no typo builds a huge list


def core_list(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8) (``--bind_core_list``; DeepSpeed's ``utils.numa.parse_range_list``).

    Raises:
        UsageError: a part that is not a core or a range, an empty range, a core listed twice.
    """
    cores: list[int] = []
    for part in text.split(",") if text else ():
        m = _CORE_RANGE.fullmatch(part.strip())
        if m is None:
            raise UsageError(f"--bind_core_list {text!r}: {part!r} is not a core or a range; "
                             "expected cores like '0-3,8'")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise UsageError(f"--bind_core_list {text!r}: range {part!r} is empty; "
                             f"write it low-high ('{hi}-{lo}')")
        twice = set(cores).intersection(range(lo, hi + 1))
        if twice:
            raise UsageError(f"--bind_core_list {text!r}: core {min(twice)} is listed twice")
        cores.extend(range(lo, hi + 1))
    return tuple(cores)


def check_script(cfg: LaunchConfig) -> None:
    """Local and sbatch jobs: a missing script is one clear line, not N identical Python errors."""
    if cfg.module:
        if not _module_found(cfg.user_script):
            raise UsageError(f"--module: no module named {cfg.user_script.partition('.')[0]!r} "
                             f"(searched {os.getcwd()} and the import path of {sys.executable})")
    elif cfg.no_python:
        if not (shutil.which(cfg.user_script) or os.path.exists(cfg.user_script)):
            raise UsageError(f"--no_python: program {cfg.user_script!r} not found")
    elif not os.path.isfile(cfg.user_script):
        raise UsageError(f"user script {cfg.user_script!r} not found (cwd: {os.getcwd()})")


def _module_found(name: str) -> bool:
    """Whether the workers' ``python -m name`` can find the top-level package of ``name``.

    Only the first dotted part is looked up: finding ``pkg.sub`` would import ``pkg`` (perhaps
    torch) into this lean process. Top-level lookups import nothing. The cwd is searched too:
    ``python -m`` puts it first on the workers' path, but not on this console script's.
    """
    top = name.partition(".")[0]
    if not top:  # '.mod': python -m refuses relative names
        return False
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # a broken finder, or a loaded module without __spec__
        return True  # cannot tell: let the workers report it
    return found or importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None


def _toward_master(job: JobSpec, env: Mapping[str, str]) -> JobSpec:
    """A ``--no_ssh`` node (a pod) names its interface toward node 0 for gloo and NCCL, as the SSH
    runner's probe does for its hosts: otherwise gloo advertises whatever the host name resolves
    to, 127.0.0.1 on hosts without a DNS entry for themselves. The user's variables win."""
    from dslaunch.launcher.agent.bootstrap import route
    from dslaunch.launcher.workerenv import interface_env

    node = job.nodes[0]
    named = interface_env(route(job.master_addr, job.master_port).get("iface"), {**env, **node.env})
    return replace(job, nodes=(replace(node, env={**node.env, **named}),)) if named else job


def launch_job(cfg: LaunchConfig, dry_run: bool, policy: RestartPolicy, from_config: Mapping[str, str]) -> int:
    """Plan ``cfg`` and run it to its end under ``policy`` (or print the plan: ``dry_run``); returns
    the job's exit code. ``from_config``: the ds_config monitor keys it was filled from (``--dry-run``).

    Raises:
        DslaunchError: a user mistake or a failed job.
    """
    cfg = replace(cfg, job_id=job_id())  # every run of the job has it (its restarts are re-planned from cfg)
    plan = build_job(cfg, gpus.detect)
    job = _toward_master(plan.job, os.environ) if cfg.no_ssh else plan.job
    # Only a local node keeps spares here: a remote agent is a new process at every run (a Ray
    # node's actor, kept for the job, keeps them itself: ``RayNodes``).
    kept = _kept(job.launcher, policy.max_restarts if cfg.warm_spares else 0)
    runner = _runner(job.launcher, kept)  # an unknown --launcher fails before any note is printed
    if job.launcher == "local":
        check_script(cfg)  # also for --dry-run: it fails like a real run would
    for note in plan.notes:
        say(cfg.log_level, "info", f"dslaunch: {note}")
    if dry_run:
        print(runner.dry_run(job), flush=True)  # a closed pipe raises here, inside main's handler
        print(_monitor_line(job), flush=True)
        if policy.max_restarts:  # the default (no restarts) adds nothing to what was shown before
            print(f"# {policy.describe()}", flush=True)
        if from_config:
            print(f"# from the ds_config's monitor block ({next(iter(from_config.values()))}): "
                  f"{', '.join(from_config)} (flags win over it)", flush=True)
        return 0
    if job.launcher == "local" and job.nodes[0].node_rank == 0:  # node 0 (rank 0) listens; others connect
        from dslaunch.launcher.ports import check_port_free

        check_port_free(job.master_port)

    def plan_attempt(attempt: Attempt) -> JobSpec:
        if attempt.restart_count == 0 and not attempt.drop:
            return job
        # A fresh port per restart: the last run's may linger (TIME_WAIT, a straggler's store).
        fixed = cfg.master_port_given or cfg.no_ssh  # --no_ssh nodes cannot agree on a new one
        again = replace(cfg, restart_count=attempt.restart_count, restart_reason=attempt.reason,
                        drop_hosts=tuple(sorted(attempt.drop)),
                        master_port=cfg.master_port if fixed else free_port())
        new = build_job(again, gpus.detect).job
        if new.world_size != job.world_size and (batch := elastic_batch_for(cfg, new.world_size)):
            say(cfg.log_level, "info", f"dslaunch: elasticity: world size {new.world_size} gets {batch}")
        return new

    runners = iter([runner])  # the first run uses the runner made above, later runs new ones
    # one log for the job, whatever its restarts
    events = EventLog(job.monitor.log_dir, echo=lambda event: print_event(event, cfg.log_level))
    preemption = Preemption(enabled=job.launcher == "slurm")
    loop = JobLoop(policy, plan_attempt,
                   lambda j: preemption.track(next(runners, None) or _runner(j.launcher, kept)), events)
    started = time.monotonic()
    code: int | None = None
    try:
        code = _run(loop, policy, preemption, cfg.log_level)
        return code
    except DslaunchError as err:
        code = err.exit_code
        raise
    finally:
        if kept is not None:
            kept.close()
        free_memory_stores(events.events, cfg.job_id)  # the job's snapshots in host memory
        events.emit("end", exit_code=code, duration_s=round(time.monotonic() - started, 3))
        events.close()


def _kept(name: str, restarts: int):  # -> SparePool | RayNodes | None
    """What the job keeps across its runs (closed when it ends): the local node's spares, or the
    Ray nodes' placement group and actors (with standby agents and spares while one of
    ``restarts`` is left)."""
    if name == "ray":
        from dslaunch.launcher.runners.ray.nodes import RayNodes

        return RayNodes(restarts)
    return SparePool(os.environ) if name == "local" and restarts else None


def _runner(name: str, kept):  # -> Runner
    """A new runner for one run, given what the job keeps (``_kept``)."""
    if name == "local":
        return LocalRunner(kept)
    return get_runner(name)(kept) if name == "ray" else get_runner(name)()


def _monitor_line(job: JobSpec) -> str:
    """What ``--dry-run`` says about the monitor."""
    t = job.monitor.hang_timeout
    hang = f"{t:g} s (first step: {max(t, FIRST_STEP_ALLOWANCE_S):g} s)" if t is not None else "off"
    return f"# monitor: hang_timeout {hang}; events, error files and stacks in {job.monitor.log_dir}"


def _run(loop: JobLoop, policy: RestartPolicy, preemption: Preemption, log_level: str) -> int:
    """Run the job with stop signals forwarded to it (SLURM's warning signal: a checkpoint
    request, then a requeue); turn a failure into WorkerFailedError."""

    def on_signal(signum: int, _frame: object) -> None:
        loop.stop(signum)

    previous = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS}
    preemption.install()
    try:
        outcome = loop.run()
    finally:
        preemption.restore()
        for s, h in previous.items():
            signal.signal(s, h)
    if preemption.requested and preemption.requeue(os.environ.get("SLURM_JOB_ID", "")):
        return 0  # SLURM ends this run and starts the job again; it resumes from the checkpoint
    result, code = outcome.result, outcome.exit_code
    if result.failure is not None:
        f = result.failure
        stopped = "stopped all workers" if f.cause == "hang" else "stopped all other workers"
        details = f"; {result.details}" if result.details else ""
        why = f"; {outcome.decision.reason}" if policy.max_restarts else ""
        raise WorkerFailedError(f"{f.describe()}; {stopped}{why}{details}",
                                rank=f.rank if f.rank is not None else -1,
                                exit_code=f.job_exit_code, host=f.host, signal_name=f.signal_name)
    if result.stopped_by:
        say(log_level, "warning", f"dslaunch: stopped by {result.stopped_by}; all workers stopped (exit code {code})")
    return code


def run(argv: list[str]) -> int:
    """The launch command: parse ``argv`` (no command name), start the job, return its exit code.

    Raises:
        DslaunchError: a user mistake or a failed job (``cli.main`` prints it).
    """
    cfg, ns = parse_config(argv)
    return launch_job(cfg, ns.dry_run, restart_policy(ns, requeued_by_slurm=cfg.allocation is not None),
                      ns.monitor_from)
