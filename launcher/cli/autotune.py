"""``dslaunch --autotuning tune|run [launcher options] script --deepspeed_config ds.json``.

``--dry-run`` prints the candidates and an experiment's command and runs nothing. ``tune`` searches the script's ``autotuning`` block's space, each experiment launched by
dslaunch with the same launcher options on the same hosts, prints the results table and writes
it with the best config to ``results_dir``; it exits 0 when the search finished (also when no
candidate could be measured: the table says why). ``run`` tunes, then launches the job with the
best config (its exit code is the job's). Errors before the search (no ds_config, a bad block)
are one line.
"""

from __future__ import annotations

import os
import shlex
import sys
from functools import partial
from pathlib import Path

from dslaunch.errors import LaunchError, UsageError
from dslaunch.launcher import gpus
from dslaunch.launcher.autotuning.estimate import engine_estimate, memory_limit
from dslaunch.launcher.autotuning.experiments import Experiment, ExperimentRunner, Outcome, set_flag
from dslaunch.launcher.autotuning.space import Candidate
from dslaunch.launcher.autotuning.tune import TuneJob, candidates, table, tune, write_results
from dslaunch.launcher.cli import launch
from dslaunch.launcher.cli.flags import build_parser
from dslaunch.launcher.plan import build_job, ds_config_path
from dslaunch.safe_write import explain, make_dirs
from dslaunch.utils.ports import free_port

__all__ = ["run", "split_argv"]


def split_argv(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """``argv`` -> (mode, the launcher's flags without ``--autotuning``, [script, *script args]);
    mode ``dry-run`` for ``--dry-run`` (then left out of the flags: they are the experiments')."""
    ns = build_parser().parse_args(argv)
    cut = len(argv) - len(ns.user_args) - 1
    flags, script = argv[:cut], argv[cut:]
    out: list[str] = []
    skip = False
    for arg in flags:
        if skip:
            skip = False
        elif arg == "--autotuning":
            skip = True
        elif not arg.startswith("--autotuning=") and arg not in ("--dry-run", "--dry_run"):
            out.append(arg)
    return "dry-run" if ns.dry_run else ns.autotuning, out, script


def run(argv: list[str]) -> int:
    """Tune (and with ``run``, launch the best); returns the exit code.

    Raises:
        DslaunchError: bad flags or config (one line), or ``run`` with nothing measured.
    """
    from dslaunch.runtime.config import load_config
    from dslaunch.runtime.config.file import read_config_file

    mode, flags, script = split_argv(argv)
    cfg, _ = launch.parse_config([*flags, *script])
    path = ds_config_path(cfg.user_args)
    if path is None:
        raise UsageError("--autotuning needs the script's ds_config: add --deepspeed_config ds.json to its "
                         "arguments (the autotuning block and the base config are read from it)")
    given = any(a == "--deepspeed_config" or a.startswith("--deepspeed_config=") for a in cfg.user_args)
    config_flag = "--deepspeed_config" if given else "--deepspeed"  # else Hugging Face's
    job = build_job(cfg, gpus.detect).job
    raw = read_config_file(Path(path))
    at = load_config(raw, job.world_size).autotuning  # the whole config is checked, not only the block
    dp_world = max(1, job.world_size // at.mp_size)
    per_node = max(len(n.workers) for n in job.nodes)
    acc = gpus.detect()  # this machine's; the hosts are taken to be alike
    limit = memory_limit(at.memory_per_device, per_node, min(acc.memory) if acc.kind == "cuda" and acc.memory else None)
    runner = ExperimentRunner(flags, script, config_flag, at.exps_dir, at.experiment_timeout, at.hang_timeout,
                              at.arg_mappings, reuse=not at.overwrite)
    tune_job = TuneJob(dict(raw), at, dp_world, runner, limit,
                       partial(engine_estimate, gpus_per_node=per_node, nodes=len(job.nodes), accelerator=acc.kind))
    if mode == "dry-run":
        return _dry_run(tune_job)
    for key, where in (("exps_dir", at.exps_dir), ("results_dir", at.results_dir)):
        try:  # before hours of experiments: a directory refused now, not at the end
            make_dirs(where)
        except OSError as err:
            raise LaunchError(f"autotuning.{key}: {explain(err, where)}") from None
    print(f"dslaunch: autotuning: {at.tuner_type} over ZeRO stages, offload, activation checkpointing and "
          f"batch sizes; {limit / 2**20:.0f} MiB per rank; experiments in {at.exps_dir}", file=sys.stderr,
          flush=True)
    result = tune(tune_job, on_result=_progress)
    best = write_results(at.results_dir, result, tune_job)
    print(table(result, at.metric), flush=True)
    if best is not None:
        print(f"dslaunch: autotuning: best config written to {best}", file=sys.stderr, flush=True)
    if mode == "tune":
        return 0
    if best is None:
        raise LaunchError(f"autotuning measured no candidate, so there is no config to run; see "
                          f"{at.results_dir}/summary.txt")
    # as a restart does: a fresh port unless one was given (the experiments' may linger in TIME_WAIT)
    port = [] if runner.port_given else ["--master_port", str(free_port())]
    return launch.run([*flags, *port, script[0], *set_flag(script[1:], config_flag, best)])


def _dry_run(job: TuneJob) -> int:
    """Print the space and the first experiment's command; run nothing."""
    space = candidates(job)
    print(f"# autotuning: {len(space)} candidates ({job.at.tuner_type}, at most {job.at.tuner_num_trials} "
          f"experiments, {job.memory_limit / 2**20:.0f} MiB per rank)", flush=True)
    for c in space:
        print(c.name, flush=True)
    first = Experiment(space[0].name, {})
    where = os.path.join(job.runner.exps_dir, first.name)
    command = job.runner.command(first, os.path.join(where, "ds_config.json"), os.path.join(where, "logs"))
    print(f"# each experiment, e.g.: {shlex.join(command)}", flush=True)
    return 0


def _progress(c: Candidate, o: Outcome) -> None:
    if o.status != "pruned":
        print(f"dslaunch: autotuning: {c.name}: {o.status} ({o.seconds:.1f} s){': ' + o.message if o.message else ''}",
              file=sys.stderr, flush=True)
