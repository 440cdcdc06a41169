"""``dslaunch sbatch``: submit a dslaunch job to SLURM.

Usage::

    dslaunch sbatch --nodes N [--num_gpus G] [--partition P --time T --account A --job_name J
                    --output F --error F --requeue --signal SPEC --gpus_per_node G --wait]
                    [--sbatch_args '...'] [--dry-run] [launcher options] user_script [script args]

Writes a batch script (``batch_script``) whose ``#SBATCH`` lines ask for N nodes with G tasks (and
by default G GPUs) each, and whose one command runs ``dslaunch --launcher slurm`` with the
launcher options and the script inside the allocation (``exec``: a signal SLURM sends the batch
shell reaches dslaunch). It is passed to ``sbatch --parsable`` on stdin (SLURM keeps its own copy)
and ``Submitted batch job <id>`` is printed as sbatch prints it. ``--dry-run`` prints the script
and the sbatch command instead. ``--wait`` blocks until the job ends (a requeued job is waited for
again) and exits with its exit code, as ``sbatch --wait`` does, but polls every second instead of
sbatch's backoff of up to 32 s.

With ``--resume_from DIR`` the script asks for ``--signal=B:USR1@120`` (unless ``--signal`` is
given): dslaunch turns it into a checkpoint into DIR and, when the job may be requeued
(``--requeue``), requeues it; the requeued job resumes from DIR (``slurm.preemption``).

Options sbatch has but this command does not name are an error naming the option; pass them
verbatim with ``--sbatch_args``. The launcher options are checked here, before submitting, so a
typo fails now rather than in the queue. ``scripts/slurm/dslaunch.sbatch`` is the same script as
a template for users who prefer to edit one.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dslaunch import __version__
from dslaunch.errors import LaunchError, UsageError
from dslaunch.launcher.cli.flags import NOT_SUPPORTED, build_parser, integer
from dslaunch.launcher.cli.launch import parse_config
from dslaunch.launcher.plan import check_numbers

__all__ = ["BatchSpec", "batch_script", "run", "wait_for_job"]

# (flag, sbatch's name, takes a value): the sbatch options this command knows.
_SBATCH_OPTIONS: tuple[tuple[str, str, bool], ...] = (
    ("--partition", "partition", True),
    ("--time", "time", True),
    ("--account", "account", True),
    ("--job_name", "job-name", True),
    ("--output", "output", True),
    ("--error", "error", True),
    ("--signal", "signal", True),
    ("--requeue", "requeue", False),
)
_OURS = {"--nodes": True, "--gpus_per_node": True, "--gpus-per-node": True, "--sbatch_args": True,
         "--wait": False, "--dry-run": False, "--dry_run": False, **{flag: value for flag, _name, value in _SBATCH_OPTIONS},
         **{f"--{name}": value for _flag, name, value in _SBATCH_OPTIONS}}
"""Every sbatch-only flag (not passed on to the launcher) -> whether it takes a value."""
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
          "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT")
_POLL_S = 1.0
DEFAULT_SIGNAL = "B:USR1@120"
"""With ``--resume_from``: SIGUSR1 to dslaunch (the batch shell) 2 minutes before the time limit."""


@dataclass(frozen=True)
class BatchSpec:
    """What the batch script asks SLURM for, and what it runs."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    sbatch: tuple[tuple[str, str | None], ...]
    """(sbatch option name, value or None for a switch), in the order given."""
    launch_argv: tuple[str, ...]
    """dslaunch's arguments inside the allocation: launcher options, script, script arguments."""
    cwd: str
    python: str


def batch_script(spec: BatchSpec) -> str:
    """The batch script's text (see the module docstring)."""
    lines = ["#!/bin/bash", f"# Written by 'dslaunch sbatch' (dslaunch {__version__}): runs dslaunch inside "
             "the allocation, one node agent per node through srun.",
             f"#SBATCH --nodes={spec.nodes}", f"#SBATCH --ntasks-per-node={spec.tasks_per_node}"]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    lines += [f"#SBATCH --{name}" + ("" if value is None else f"={value}") for name, value in spec.sbatch]
    lines.append(f"#SBATCH --chdir={spec.cwd}")
    command = [spec.python, "-m", "dslaunch.launcher.cli", "--launcher", "slurm", *spec.launch_argv]
    lines += ["", f"cd {shlex.quote(spec.cwd)}", f"exec {shlex.join(command)}", ""]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = build_parser(prog="dslaunch sbatch", description="Submit a dslaunch job to SLURM (sbatch).",
                     unsupported=tuple(f for f in NOT_SUPPORTED if f != "--account"))
    g = p.add_argument_group("sbatch").add_argument
    g("--nodes", type=integer, required=True, help="nodes to allocate (sbatch --nodes)")
    g("--gpus_per_node", "--gpus-per-node", type=integer, default=None,
      help="GPUs to allocate per node (default: --num_gpus; 0 = none, e.g. CPU-only clusters)")
    for flag, name, value in _SBATCH_OPTIONS:
        names = (flag, f"--{name}") if f"--{name}" != flag else (flag,)  # sbatch's own spelling too
        if value:
            g(*names, default=None, help=f"sbatch --{name}")
        else:
            g(*names, action="store_true", help=f"sbatch --{name}")
    g("--sbatch_args", default="", help="other sbatch options, verbatim (e.g. '--qos=high --exclusive')")
    g("--wait", action="store_true", help="wait for the job to end and exit with its exit code")
    return p


def _launch_argv(argv: Sequence[str], script_at: int) -> list[str]:
    """``argv`` without the sbatch-only options (before the user script at ``script_at``)."""
    out: list[str] = []
    i = 0
    while i < script_at:
        flag = argv[i].split("=", 1)[0]
        if flag in _OURS:
            i += 2 if _OURS[flag] and "=" not in argv[i] else 1
            continue
        out.append(argv[i])
        i += 1
    return out + list(argv[script_at:])


def _script_index(argv: Sequence[str], script: str, script_args: Sequence[str]) -> int:
    """Where the user script starts in ``argv`` (its arguments follow it to the end)."""
    index = len(argv) - len(script_args) - 1
    assert argv[index] == script, (argv, script)
    return index


def _spec(argv: list[str]) -> tuple[BatchSpec, argparse.Namespace]:
    parser = _parser()
    flat = parser._attach_values(argv)  # type: ignore[attr-defined]
    try:
        ns = parser.parse_args(flat)
    except UsageError as err:
        text = str(err)
        if "unrecognized arguments: " not in text:
            raise
        flag = text.split("unrecognized arguments: ", 1)[1].split()[0].split("=")[0]
        named = ", ".join(f for f, _n, _v in _SBATCH_OPTIONS)
        raise UsageError(f"unknown option {flag}: dslaunch sbatch takes --nodes, --gpus_per_node, {named}, "
                         f"--wait and the launcher's options; pass other sbatch options verbatim with "
                         f"--sbatch_args '{flag} ...'") from None
    launch = _launch_argv(flat, _script_index(flat, ns.user_script, ns.user_args))
    cfg, _ = parse_config(launch, {})  # the launcher options, checked before anything is submitted
    check_numbers(cfg)
    if ns.nodes < 1:
        raise UsageError(f"--nodes {ns.nodes}: expected 1 or more nodes")
    if ns.hostfile is not None or cfg.no_ssh or ns.launcher not in ("", "slurm"):
        raise UsageError("dslaunch sbatch runs the job through srun inside the allocation: leave out "
                         "--hostfile, --no_ssh and --launcher")
    per_node = max(1, ns.num_gpus)
    gpus = per_node if ns.gpus_per_node is None and ns.num_gpus > 0 else (ns.gpus_per_node or 0)
    sbatch = tuple((name, getattr(ns, flag[2:]) if value else None)
                   for flag, name, value in _SBATCH_OPTIONS if getattr(ns, flag[2:]) not in (None, False))
    if ns.resume_from and ns.signal is None:  # a warning before the end: checkpoint, then requeue
        sbatch += (("signal", DEFAULT_SIGNAL),)
    return BatchSpec(ns.nodes, per_node, gpus, sbatch, tuple(launch), os.getcwd(), sys.executable), ns


def _sbatch_command(ns: argparse.Namespace) -> list[str]:
    return ["sbatch", "--parsable", *shlex.split(ns.sbatch_args)]


def _submit(command: list[str], script: str) -> str:
    try:
        done = subprocess.run(command, input=script, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise LaunchError("sbatch not found: run dslaunch sbatch on a SLURM login node") from None
    if done.returncode != 0:
        why = " | ".join(done.stderr.strip().splitlines()[-3:])[:500] or f"exit code {done.returncode}"
        raise LaunchError(f"sbatch refused the job: {why}")
    return done.stdout.strip().split(";")[0]


def wait_for_job(job_id: str, poll_s: float = _POLL_S) -> int:
    """Block until SLURM job ``job_id`` ends; its exit code (``128+N`` when signal N ended it).

    Raises:
        LaunchError: SLURM no longer knows the job (it ended longer ago than MinJobAge).
    """
    while True:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                             timeout=60)
        fields = dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)
        state = fields.get("JobState")
        if out.returncode != 0 or state is None:
            raise LaunchError(f"SLURM no longer knows job {job_id}: {out.stderr.strip()[:300]}")
        if state in _ENDED:
            code, _, sig = fields.get("ExitCode", "0:0").partition(":")
            return 128 + int(sig) if sig and int(sig) else int(code)
        time.sleep(poll_s)


def run(argv: list[str]) -> int:
    """The sbatch command (``argv`` without the command name).

    Raises:
        DslaunchError: a bad option, or sbatch refused the job (``cli.main`` prints it).
    """
    spec, ns = _spec(argv)
    script = batch_script(spec)
    command = _sbatch_command(ns)
    if ns.dry_run:
        print(f"# {shlex.join(command)} < (this script)\n{script}", end="", flush=True)
        return 0
    job_id = _submit(command, script)
    print(f"Submitted batch job {job_id}", flush=True)
    if not ns.wait:
        return 0
    try:
        return wait_for_job(job_id)
    except KeyboardInterrupt:
        print(f"dslaunch sbatch: stopped waiting; job {job_id} keeps running (scancel {job_id} stops it)",
              file=sys.stderr, flush=True)
        raise
