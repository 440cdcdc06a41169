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

GPUs: ``--num_gpus G`` asks for G GPUs per node only where the partition has GPUs. Before
submitting (and for ``--dry-run``) ``sinfo`` tells which GRES its nodes offer (``slurm.gres``); on
a partition without ``gpu`` GRES the script asks for G tasks per node and no GPUs (the ranks then
run on CPUs, as the local launcher does on a machine without GPUs), and a note says which it
chose. Where SLURM cannot be asked the script asks for GPUs, and the note says so.
``--gpus_per_node`` always wins.

Every value in an ``#SBATCH`` line is written so that sbatch reads it as one argument (quoted
when it has blanks, quotes or ``#``); a value with a line break or another control character is
refused, as it would end the line and run the rest as a command of the batch script.

Options sbatch has but this command does not name are an error naming the option; pass them
verbatim with ``--sbatch_args`` (split like a shell line). The launcher options, the restart
flags and the script's existence are checked here, as the launcher inside the allocation would,
before submitting, so a typo fails now rather than in the queue.

``scripts/slurm/dslaunch.sbatch`` is the same script as a template for users who prefer to edit one.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dslaunch import __version__
from dslaunch.errors import LaunchError, UsageError, quote
from dslaunch.launcher.cli.flags import NOT_SUPPORTED, build_parser, integer
from dslaunch.launcher.cli.launch import check_script, parse_config, restart_policy
from dslaunch.launcher.hostfile import MAX_SLOTS
from dslaunch.launcher.log_level import chosen, say
from dslaunch.launcher.plan import check_numbers
from dslaunch.launcher.runners.slurm.gres import partition_gpus

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
         "--wait": False, "--dry-run": False, "--dry_run": False,
         **{flag: value for flag, _name, value in _SBATCH_OPTIONS},
         **{f"--{name}": value for _flag, name, value in _SBATCH_OPTIONS}}
"""Every sbatch-only flag (not passed on to the launcher) -> whether it takes a value."""
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
          "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT")
_POLL_S = 1.0
_PLAIN = re.compile(r"[\w@%+=:,./\[\]-]+")
"""An ``#SBATCH`` value written as it is; any other goes in double quotes (``_directive``)."""
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
    submit: tuple[str, ...] = ("sbatch", "--parsable")
    """The sbatch command that reads the script on stdin (``--sbatch_args`` included)."""
    notes: tuple[str, ...] = ()
    """What dslaunch chose for the user (GPUs or not), said once before submitting."""


def batch_script(spec: BatchSpec) -> str:
    """The batch script's text (see the module docstring)."""
    lines = ["#!/bin/bash", f"# Written by 'dslaunch sbatch' (dslaunch {__version__}): runs dslaunch inside "
             "the allocation, one node agent per node through srun.",
             _directive("nodes", str(spec.nodes)), _directive("ntasks-per-node", str(spec.tasks_per_node))]
    if spec.gpus_per_node:
        lines.append(_directive("gpus-per-node", str(spec.gpus_per_node)))
    lines += [_directive(name, value) for name, value in spec.sbatch]
    lines.append(_directive("chdir", spec.cwd))
    command = [spec.python, "-m", "dslaunch.launcher.cli", "--launcher", "slurm", *spec.launch_argv]
    lines += ["", f"cd {shlex.quote(spec.cwd)}", f"exec {shlex.join(command)}", ""]
    return "\n".join(lines)


def _directive(name: str, value: str | None) -> str:
    """One ``#SBATCH`` line. sbatch splits these lines at blanks, ends them at an unquoted ``#``
    and reads quotes and backslash escapes: a value that is not a plain word goes in double quotes
    with ``"`` and ``\\`` escaped, so that it stays one argument (``--job-name=a --uid=0`` would
    be two). Line breaks cannot be quoted there: ``_one_line`` refuses them first."""
    if value is None:
        return f"#SBATCH --{name}"
    if not _PLAIN.fullmatch(value):
        value = '"' + re.sub(r'(["\\])', r"\\\1", value) + '"'
    return f"#SBATCH --{name}={value}"


def _one_line(what: str, value: str, fix: str) -> str:
    """``value``, unless it would end its ``#SBATCH`` line (the rest would run as a command)."""
    if not value.isprintable():
        raise UsageError(f"{what} {quote(value)} holds a line break or another control character: in the "
                         f"batch script it would end its #SBATCH line and run the rest as a command; {fix}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = build_parser(prog="dslaunch sbatch", description="Submit a dslaunch job to SLURM (sbatch).",
                     unsupported=(*(f for f in NOT_SUPPORTED if f != "--account"), "--autotuning"))
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
    # The launcher options, checked as the launcher inside the allocation will, before anything is submitted.
    cfg, launch_ns = parse_config(launch, {})
    check_numbers(cfg)
    restart_policy(launch_ns, requeued_by_slurm=True)
    if ns.nodes < 1:
        raise UsageError(f"--nodes {ns.nodes}: expected 1 or more nodes")
    if ns.gpus_per_node is not None and not 0 <= ns.gpus_per_node <= MAX_SLOTS:
        raise UsageError(f"--gpus_per_node {ns.gpus_per_node}: expected 0 to {MAX_SLOTS} GPUs per node "
                         "(0 = none; leave it out to ask for --num_gpus where the partition has GPUs)")
    if ns.hostfile is not None or cfg.no_ssh or ns.launcher not in ("", "slurm"):
        raise UsageError("dslaunch sbatch runs the job through srun inside the allocation: leave out "
                         "--hostfile, --no_ssh and --launcher")
    sbatch = tuple((name, _one_line(flag, getattr(ns, flag[2:]), "give it on one line") if value else None)
                   for flag, name, value in _SBATCH_OPTIONS if getattr(ns, flag[2:]) not in (None, False))
    if ns.resume_from and ns.signal is None:  # a warning before the end: checkpoint, then requeue
        sbatch += (("signal", DEFAULT_SIGNAL),)
    cwd = _one_line("the working directory", os.getcwd(), "run dslaunch sbatch from a directory whose path "
                    "has none")
    submit = _sbatch_command(ns.sbatch_args)
    check_script(cfg)  # last: the flags' own mistakes come first
    per_node = max(1, ns.num_gpus)
    gpus, note = _gpus_per_node(ns, per_node)
    return BatchSpec(ns.nodes, per_node, gpus, sbatch, tuple(launch), cwd, sys.executable, submit,
                     (note,) if note else ()), ns


def _gpus_per_node(ns: argparse.Namespace, per_node: int) -> tuple[int, str | None]:
    """GPUs to ask for per node, and a note saying why when the partition decided.

    ``--gpus_per_node`` wins; without ``--num_gpus`` none are asked for; else ``per_node`` where
    the partition has GPUs (or SLURM cannot be asked), 0 where it has none.

    Raises:
        UsageError: an unknown partition, or more GPUs per node than its nodes have.
    """
    if ns.gpus_per_node is not None:
        return ns.gpus_per_node, None
    if ns.num_gpus <= 0:
        return 0, None
    # sbatch itself reads SBATCH_PARTITION when --partition is not given.
    given, source = (ns.partition, "--partition") if ns.partition else \
        (os.environ.get("SBATCH_PARTITION") or None, "SBATCH_PARTITION")
    try:
        offer = partition_gpus(given, source=source)
    except LaunchError as err:
        return per_node, (f"cannot ask SLURM which GPUs the partition offers ({err}): the batch script "
                          f"asks for {per_node} GPUs per node (--num_gpus); add --gpus_per_node 0 for nodes "
                          "without GPUs")
    name = quote(offer.partition)
    if not offer.gpus_per_node:
        return 0, (f"partition {name} has no GPUs (no gpu GRES on its nodes): asking for {per_node} "
                   f"tasks per node and no GPUs, the ranks run on CPUs (--gpus_per_node N asks for GPUs)")
    if per_node > offer.gpus_per_node:  # SLURM would refuse: "Requested node configuration is not available"
        raise UsageError(f"--num_gpus {per_node}: the nodes of partition {name} have at most "
                         f"{offer.gpus_per_node} GPUs; ask for {offer.gpus_per_node} or fewer per node")
    return per_node, (f"partition {name} has GPUs (up to {offer.gpus_per_node} per node): asking for "
                      f"{per_node} GPUs per node")


def _sbatch_command(sbatch_args: str) -> tuple[str, ...]:
    try:
        extra = shlex.split(sbatch_args)
    except ValueError as err:  # "No closing quotation", "No escaped character"
        raise UsageError(f"--sbatch_args {quote(sbatch_args)}: {str(err).lower()}; it is split like a "
                         "shell line: quote values with blanks, e.g. --sbatch_args \"--comment='my run'\""
                         ) from None
    return ("sbatch", "--parsable", *extra)


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
    for note in spec.notes:
        say(chosen(ns.log_level, ns.quiet), "info", f"dslaunch: {note}")
    if ns.dry_run:
        print(f"# {shlex.join(spec.submit)} < (this script)\n{script}", end="", flush=True)
        return 0
    job_id = _submit(list(spec.submit), script)
    print(f"Submitted batch job {job_id}", flush=True)
    if not ns.wait:
        return 0
    try:
        return wait_for_job(job_id)
    except KeyboardInterrupt:
        print(f"dslaunch sbatch: stopped waiting; job {job_id} keeps running (scancel {job_id} stops it)",
              file=sys.stderr, flush=True)
        raise
