"""Running one experiment: the user's job, launched by dslaunch itself with a candidate's config.

Each experiment is the user's own command (hosts, launcher, flags, script, arguments) with the
ds_config replaced by the experiment's (``--deepspeed_config`` / Hugging Face's ``--deepspeed``;
``arg_mappings`` flags set too), ``--hang_timeout`` and ``--log_dir`` added, and a fresh master
port. It runs as a child ``dslaunch`` process (``python -m dslaunch.launcher.cli``), so it goes
through the same plan, runner (local, ssh, slurm), gang teardown and hang detection as any job,
and nothing an experiment does (a crash, a hang, a kernel OOM kill) can stall the tuner: after
``experiment_timeout`` the child gets SIGTERM (it stops every worker), then SIGKILL (its watchdog
and the agents' PDEATHSIG stop them).

The outcome comes from the run: the metrics file the engine writes (``runtime/autotuning.py``),
else the job's ``events.jsonl`` failure (its cause: ``oom``, ``hang``, ``exception``, ...) and
the ``dslaunch: error:`` line. Everything an experiment leaves is in ``exps_dir/<name>/``:
``ds_config.json``, ``output.log``, ``metrics.json``, ``logs/`` and ``result.json``.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dslaunch.errors import LaunchError, UsageError
from dslaunch.launcher.monitor.events import EVENTS_FILE, read_events
from dslaunch.launcher.monitor.failures import is_oom_text
from dslaunch.launcher.spec import HANG_EXIT_CODE
from dslaunch.safe_write import create_replacing, explain, open_dir, remove_file, write_file
from dslaunch.textfile import Fail, read_json
from dslaunch.utils.ports import free_port

__all__ = ["Experiment", "Outcome", "ExperimentRunner", "STATUSES", "set_flag"]

STATUSES = ("ok", "oom", "hang", "timeout", "failed", "no_metric", "pruned")
"""How an experiment ended: measured; out of memory; hung (the monitor's hang detection); stopped
at ``experiment_timeout``; failed otherwise; ended without reaching ``end_profile_step``; or never
run (the estimator or an earlier OOM ruled it out)."""

_STOP_WAIT_S = 10.0  # after SIGTERM, how long the child dslaunch gets to stop its workers


@dataclass(frozen=True)
class Experiment:
    name: str
    ds_config: Mapping[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What one experiment gave."""

    name: str
    status: str
    metrics: Mapping[str, Any]
    """The engine's measurement (``throughput``, ``latency``, ``FLOPS_per_gpu``, ``peak_memory``,
    ``num_params``); empty unless ``status`` is ok."""
    message: str = ""
    seconds: float = 0.0
    """Wall time of the experiment, launch and teardown included."""
    estimate: int | None = None
    """The estimator's bytes per rank, where it was asked."""

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"metrics": dict(self.metrics)})

    @classmethod
    def from_json(cls, text: str) -> Outcome:
        return cls(**json.loads(text))


class ExperimentRunner:
    """Launches experiments as the user's command would run, one at a time.

    Args:
        launcher_argv: the launcher's flags as the user gave them (before the script), without
            ``--autotuning``.
        script: the user script (module, program) and its arguments.
        config_flag: how the script is told its ds_config: ``--deepspeed_config`` or ``--deepspeed``.
        exps_dir: where each experiment's directory goes.
        timeout: seconds before an experiment is stopped.
        hang_timeout: the experiments' ``--hang_timeout``.
        arg_mappings: ds_config key -> script flag to set to the experiment's value.
        reuse: an experiment whose ``result.json`` is in ``exps_dir`` is not run again (DeepSpeed's
            ``overwrite: false``).
        python: the interpreter that runs ``dslaunch`` (default: this one).
    """

    def __init__(self, launcher_argv: Sequence[str], script: Sequence[str], config_flag: str, exps_dir: str,
                 timeout: float, hang_timeout: float, arg_mappings: Mapping[str, str] | None = None,
                 reuse: bool = False, python: str = sys.executable) -> None:
        self.launcher_argv, self.script, self.config_flag = list(launcher_argv), list(script), config_flag
        self.exps_dir, self.timeout, self.hang_timeout = exps_dir, timeout, hang_timeout
        self.arg_mappings, self.reuse, self.python = dict(arg_mappings or {}), reuse, python
        # the user pinned the port: every experiment (and ``run``'s job) uses it; else each gets a free one
        self.port_given = any(a == "--master_port" or a.startswith("--master_port=") for a in launcher_argv)

    def command(self, exp: Experiment, config_path: str, log_dir: str) -> list[str]:
        """The child ``dslaunch`` command of ``exp``."""
        extra = ["--hang_timeout", f"{self.hang_timeout:g}", "--log_dir", log_dir]
        if not self.port_given:  # the last experiment's port may linger (TIME_WAIT)
            extra += ["--master_port", str(free_port())]
        args = set_flag(self.script[1:], self.config_flag, config_path)
        for key, flag in self.arg_mappings.items():
            if key in exp.ds_config:
                args = set_flag(args, flag, str(exp.ds_config[key]))
        return [self.python, "-m", "dslaunch.launcher.cli", *self.launcher_argv, *extra, self.script[0], *args]

    def run(self, exp: Experiment) -> Outcome:
        """Run ``exp`` to its end, its failure, its hang or its timeout; never raises for the job's
        own failure.

        Raises:
            LaunchError: the experiment's directory cannot be written safely (``safe_write``: a
                directory another user owns or can write, a link planted there); names it.
        """
        where = os.path.join(self.exps_dir, exp.name)
        try:
            dir_fd = open_dir(where)
        except OSError as err:
            raise LaunchError(f"autotuning: cannot write the experiment's directory: {explain(err, where)}") from None
        try:
            return self._run_in(exp, where, dir_fd)
        except OSError as err:
            raise LaunchError(f"autotuning: cannot write the experiment's files: {explain(err, where)}") from None
        finally:
            os.close(dir_fd)

    def _run_in(self, exp: Experiment, where: str, dir_fd: int) -> Outcome:
        if self.reuse and (earlier := _reusable(dir_fd)) is not None:
            return earlier
        config_path, metrics_path = os.path.join(where, "ds_config.json"), os.path.join(where, "metrics.json")
        remove_file(dir_fd, "metrics.json")  # a stale one from an earlier tune would pass for this run's
        cfg = _measured(exp.ds_config, os.path.abspath(metrics_path), where)
        write_file(dir_fd, "ds_config.json", json.dumps(cfg, indent=2))
        started = time.monotonic()
        with os.fdopen(create_replacing(dir_fd, "output.log", 0o644), "wb") as out:
            code, timed_out = self._launch(self.command(exp, config_path, os.path.join(where, "logs")), out)
        seconds = round(time.monotonic() - started, 2)
        status, message, metrics = _judge(code, timed_out, metrics_path, where, self.timeout)
        outcome = Outcome(exp.name, status, metrics, message, seconds)
        write_file(dir_fd, "result.json", outcome.to_json())
        return outcome

    def _launch(self, argv: list[str], out: Any) -> tuple[int, bool]:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            return child.wait(timeout=self.timeout), False
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGTERM)  # dslaunch stops every worker on every host
            try:
                child.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                child.kill()  # its watchdog and the workers' PDEATHSIG take the rest
                child.wait()
            return child.returncode, True
        except BaseException:  # Ctrl-C of the tuner: the experiment goes with it
            child.send_signal(signal.SIGTERM)
            child.wait()
            raise


def _read_own(dir_fd: int, name: str) -> str | None:
    """``name``'s text when it is a regular file of this user's (never read through a link), else None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with open(fd, encoding="utf-8", errors="replace") as f:
        st = os.fstat(fd)
        return f.read(1 << 20) if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else None


def _measured(ds_config: Mapping[str, Any], metrics_path: str, where: str) -> dict[str, Any]:
    """The experiment's config as it runs: ``metric_path`` set (the engine measures and leaves),
    and for ``metric: flops`` the flops profiler counting the step before the timed ones."""
    cfg = json.loads(json.dumps(ds_config))
    at = cfg.setdefault("autotuning", {})
    at["metric_path"] = metrics_path
    if str(at.get("metric", "")).lower() == "flops":
        cfg["flops_profiler"] = {"enabled": True, "profile_step": max(0, int(at.get("start_profile_step", 3)) - 1),
                                 "detailed": False, "output_file": os.path.join(os.path.abspath(where), "flops.txt")}
    return cfg


def set_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value set (``flag V`` or ``flag=V`` replaced, else appended)."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
        if arg == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
    return [*out, flag, value]


RESULT_MAX_BYTES = 16 * 2**20
"""An experiment's ``metrics.json`` or ``result.json``: a few numbers; more is not ours."""


def _refused(path: str) -> Fail:
    return lambda message, line: UsageError(f"{path}{f':{line}' if line else ''}: {message}")


def _reusable(dir_fd: int) -> Outcome | None:
    """The outcome an earlier tune recorded in the experiment's ``result.json``, or None (then the
    experiment runs again) when it is missing, not this user's regular file, or not an outcome."""
    earlier = _read_own(dir_fd, "result.json")
    try:
        return None if earlier is None else Outcome.from_json(earlier)
    except (TypeError, ValueError):
        return None


def _judge(code: int, timed_out: bool, metrics_path: str, where: str, timeout: float
           ) -> tuple[str, str, Mapping[str, Any]]:
    """(status, message, metrics) of a finished experiment."""
    if os.path.exists(metrics_path):
        try:
            metrics = read_json(metrics_path, RESULT_MAX_BYTES, _refused(metrics_path))
        except UsageError as err:
            return "failed", str(err), {}
        if isinstance(metrics, dict):
            return "ok", "", metrics
        return "failed", f"{metrics_path}: expected a JSON object of metrics", {}
    failure = _failure_event(os.path.join(where, "logs"))
    error = _error_line(os.path.join(where, "output.log"))
    if timed_out:
        return "timeout", f"stopped after experiment_timeout {timeout:g} s", {}
    if code == 0:
        return "no_metric", "the script ended before autotuning.end_profile_step", {}
    cause = (failure or {}).get("cause")
    text = " ".join(str((failure or {}).get(k) or "") for k in ("exception", "message")) + " " + error
    if cause == "oom" or is_oom_text(text):
        return "oom", error or "out of memory", {}
    if cause == "hang" or code == HANG_EXIT_CODE:
        return "hang", error or "hung", {}
    return "failed", error or f"exit code {code}", {}


def _failure_event(log_dir: str) -> dict[str, Any] | None:
    """The ``failure`` event of the experiment's job, if it logged one."""
    try:
        jobs = sorted(os.listdir(log_dir))
    except OSError:
        return None
    for job in jobs:
        try:
            with open(os.path.join(log_dir, job, EVENTS_FILE), "rb") as f:
                for event in read_events(f):
                    if event is not None and event.get("kind") == "failure":
                        return event
        except OSError:
            continue
    return None


def _error_line(path: str) -> str:
    """The last ``dslaunch: error:`` line of the experiment's output, without the prefix."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    errors = [line.split("dslaunch: error:", 1)[1].strip() for line in lines if "dslaunch: error:" in line]
    return errors[-1][:500] if errors else ""
