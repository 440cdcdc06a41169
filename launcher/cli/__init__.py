"""The ``dslaunch`` command line: one module per command, errors printed in one place.

- ``dslaunch [launcher options] user_script [args]``: the launch command (``launch.py``),
  DeepSpeed's exact flags through argparse (``flags.py``); ``__main__.py`` is ``python -m
  dslaunch.launcher.cli``. Its path imports neither torch nor click (click alone costs
  ~70 ms), so workers start within milliseconds of the command.
- ``dslaunch --autotuning tune|run ...``: the autotuner (``autotune.py``), the launch flags plus one.
- ``dslaunch sbatch ...``: submit the job to SLURM (``sbatch.py``), the launch flags plus sbatch's
  through argparse like the launch command.
- ``dslaunch NAME ...`` for a NAME in ``SUBCOMMANDS``: a click command, one module each
  (``zero_to_fp32.py``, ``ds_to_universal.py``, ``status.py``, ``estimate.py``, ``report.py``,
  ``k8s.py``, ``ssh.py``), imported only when named.

User mistakes print one line (``dslaunch: error: ...``) and exit non-zero; ``--verbose`` adds the
traceback.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback

from dslaunch.errors import DslaunchError, UsageError, shorten
from dslaunch.launcher.cli import launch
from dslaunch.launcher.cli.flags import build_parser
from dslaunch.launcher.cli.launch import parse_config

__all__ = ["main", "run", "report_error", "build_parser", "parse_config", "SUBCOMMANDS"]

SUBCOMMANDS: dict[str, str] = {
    "zero-to-fp32": "dslaunch.launcher.cli.zero_to_fp32:command",
    "ds-to-universal": "dslaunch.launcher.cli.ds_to_universal:command",
    "status": "dslaunch.launcher.cli.status:command",
    "estimate": "dslaunch.launcher.cli.estimate:command",
    "report": "dslaunch.launcher.cli.report:command",
    "k8s": "dslaunch.launcher.cli.k8s:command",
    "ssh": "dslaunch.launcher.cli.ssh:command",
}
"""Subcommand name -> ``"module:click command"``, loaded only when that name is the first word."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dslaunch`` console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run(argv)
    except DslaunchError as err:
        return report_error(err, argv)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BrokenPipeError:
        return _reader_gone()


def run(argv: list[str]) -> int:
    """Run the command ``argv`` names (no program name); return its exit code.

    Raises:
        DslaunchError: a user mistake or a failed job, for the caller to print (``main``, ``report_error``).
    """
    if argv and argv[0] in SUBCOMMANDS:
        return _subcommand(argv)
    if argv and argv[0] == "sbatch":
        from dslaunch.launcher.cli import sbatch

        return sbatch.run(argv[1:])
    if _autotuning(argv):
        from dslaunch.launcher.cli import autotune

        return autotune.run(argv)
    return launch.run(argv)


def report_error(err: DslaunchError, argv: list[str]) -> int:
    """Print ``err`` as one line (with its traceback under ``--verbose``); return its exit code.

    Not named ``report``: importing the ``report`` subcommand's module binds that name on this
    package, and ``main`` then called the module instead of printing the error."""
    if _verbose(argv):
        traceback.print_exc()
    print(f"dslaunch: error: {err}", file=sys.stderr, flush=True)
    return err.exit_code


def _subcommand(argv: list[str]) -> int:
    """Run ``argv[0]``'s click command with the rest; its errors propagate to ``main``."""
    import click

    module, _, name = SUBCOMMANDS[argv[0]].partition(":")
    command = getattr(importlib.import_module(module), name)
    try:
        return command.main(args=argv[1:], prog_name=f"dslaunch {argv[0]}", standalone_mode=False) or 0
    except click.Abort:  # click's name for a KeyboardInterrupt
        raise KeyboardInterrupt from None
    except click.ClickException as err:  # a bad option or argument: one line, as the launch command's
        raise UsageError(f"dslaunch {argv[0]}: {shorten(err.format_message(), 300)} "
                         f"(see dslaunch {argv[0]} --help)") from None


def _reader_gone() -> int:
    """Our stdout's reader exited (``dslaunch --dry-run | head -1``): exit quietly, like a tool
    killed by SIGPIPE (Python ignores SIGPIPE, so the write raised instead). stdout now points to
    /dev/null, or the interpreter's final flush would fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _autotuning(argv: list[str]) -> bool:
    """--autotuning among the launcher's own flags (a script's argument of that name is its own)."""
    if not any(a == "--autotuning" or a.startswith("--autotuning=") for a in argv):
        return False  # the usual case: no second parse
    return build_parser().parse_args(argv).autotuning is not None


def _verbose(argv: list[str]) -> bool:
    """--verbose anywhere (known even when parsing fails; a script's own -v only adds a traceback)."""
    return "--verbose" in argv or "-v" in argv
