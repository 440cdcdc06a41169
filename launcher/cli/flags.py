"""DeepSpeed's launcher flags: the parser of ``dslaunch`` (and, built on it, ``dslaunch sbatch``).

Same names, defaults and meanings as DeepSpeed's ``deepspeed`` command; flags DeepSpeed has and
dslaunch does not implement are an error naming the flag (``NOT_SUPPORTED``), not "unrecognized".
A bad flag is one ``UsageError`` line, never argparse's usage dump and exit.
"""

from __future__ import annotations

import argparse
import re
import sys

from dslaunch import __version__
from dslaunch.errors import UsageError, did_you_mean, quote
from dslaunch.launcher.hostfile import ascii_int
from dslaunch.launcher.log_level import LEVELS
from dslaunch.launcher.plan import DEFAULT_HOSTFILE, MAX_GRACE
from dslaunch.launcher.spec import DEFAULT_GRACE

__all__ = ["build_parser", "integer", "real", "NOT_SUPPORTED"]

# Options whose value is passed through verbatim and may start with '-' (e.g. ssh's "-i KEY").
_ATTACHED = ("--launcher_args", "--sbatch_args")


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) instead of printing usage and exiting."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._attach_values(args), namespace)

    def _attach_values(self, argv: list[str]) -> list[str]:
        """``--launcher_args X`` -> ``--launcher_args=X``, so that X may start with '-'.

        argparse takes a value starting with '-' (``--launcher_args "-i KEY"``) for a flag and fails
        with 'expected one argument'. Only dslaunch's own options are scanned, skipping each
        option's value: the user script and its arguments are never rewritten.
        """
        out: list[str] = []
        i = 0
        while i < len(argv):
            arg = argv[i]
            if not arg.startswith("-") or arg == "--":
                return out + argv[i:]  # the user script (or '--'): the rest is not ours
            action = self._option_string_actions.get(arg) or self._abbreviated(arg)
            takes_value = action is not None and action.nargs != 0 and i + 1 < len(argv)
            attached = [flag for flag in action.option_strings if flag in _ATTACHED] if takes_value else []
            if attached:
                out.append(f"{attached[0]}={argv[i + 1]}")
            else:
                out.extend(argv[i:i + 2] if takes_value else [arg])
            i += 2 if takes_value else 1
        return out

    def _abbreviated(self, arg: str) -> argparse.Action | None:
        """The one option ``arg`` abbreviates (``--launcher_arg``), where abbreviations are allowed."""
        if not self.allow_abbrev or not arg.startswith("--") or "=" in arg:
            return None
        matches = {a for flag, a in self._option_string_actions.items() if flag.startswith(arg)}
        return matches.pop() if len(matches) == 1 else None

    def error(self, message: str) -> None:  # type: ignore[override]
        if "unrecognized arguments" in message or message.startswith("unrecognized"):
            flag = message.rsplit(":", 1)[-1].split()[0]
            message += did_you_mean(flag.split("=")[0], self._option_string_actions)
        if len(message) > 300:  # e.g. every unknown argument, repeated: one line stays short
            message = message[:300] + "..."
        raise UsageError(f"{message} (see {self.prog} --help)")


def integer(text: str) -> int:
    """argparse type for whole-number flags: ASCII digits only, as in hostfiles (``int()`` takes '1_0')."""
    value = ascii_int(text)
    if value is None:  # argparse: "argument --num_gpus: invalid integer value: '1_0'"
        raise argparse.ArgumentTypeError(f"invalid integer value: {quote(text)}")
    return value


_REAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf(inity)?|nan)", re.IGNORECASE)


def real(text: str) -> float:
    """argparse type for decimal flags: ASCII digits only (``float()`` takes '٣' and '1_0'); the range
    (finite too: 'inf' is parsed to be refused there, by name) is checked with the other numbers."""
    if _REAL.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"invalid float value: {quote(text)}")
    return float(text)


class _NotSupported(argparse.Action):
    """A DeepSpeed launcher flag dslaunch does not implement yet: an error naming it, rather than
    'unrecognized arguments', which reads like a typo."""

    def __init__(self, option_strings: list[str], dest: str, **_: object) -> None:
        # nargs='?': the flag errors out the same with or without a value.
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        raise UsageError(f"{option_string} is a DeepSpeed launcher flag dslaunch does not support yet; "
                         "leave it out")


# DeepSpeed launcher flags answered with "not supported yet" (see _NotSupported).
NOT_SUPPORTED = ("--comment", "--account")


def build_parser(prog: str = "dslaunch", description: str = "Launch a DeepSpeed-style training script on "
                 "one or many nodes.", unsupported: tuple[str, ...] = NOT_SUPPORTED,
                 allow_abbrev: bool = False) -> argparse.ArgumentParser:
    """The launch command's parser; ``dslaunch sbatch`` builds on it (its own ``prog``, and
    ``--account`` is an sbatch option there, not an unsupported flag). ``allow_abbrev``: unique
    prefixes of long flags (``--launcher_arg``), for DeepSpeed's ``runner.parse_args``."""
    p = _Parser(prog=prog, allow_abbrev=allow_abbrev, description=description,
                epilog="Also: dslaunch sbatch ...; dslaunch zero-to-fp32 CHECKPOINT_DIR OUTPUT; dslaunch status LOGDIR; "
                       "dslaunch estimate --help; dslaunch report; dslaunch ssh -f HOSTFILE COMMAND")
    a = p.add_argument
    a("-H", "--hostfile", default=None,
      help=f"hostfile ('host slots=N' lines); default {DEFAULT_HOSTFILE}, or localhost when it does not exist")
    a("-i", "--include", default="", help="use only these hosts/slots, e.g. 'host1:0,2@host2'")
    a("-e", "--exclude", default="", help="do not use these hosts/slots, e.g. 'host1:1@host3'")
    a("--num_nodes", type=integer, default=-1, help="use the first N hosts of the hostfile")
    a("--num_gpus", "--num_accelerators", dest="num_gpus", type=integer, default=-1,
      help="workers per node (first N slots); without GPUs and hostfile: N CPU worker processes")
    a("--master_addr", default="", help="rendezvous address (default: 127.0.0.1, or the first host)")
    a("--master_port", type=integer, default=None,
      help="rendezvous port of rank 0 (default 29500; restarts then pick a free port each)")
    a("--no_ssh", action="store_true",
      help="start only this node's workers, without SSH: run the same command on every node, each with "
           "its own --node_rank (needs --master_addr)")
    a("--node_rank", type=integer, default=-1,
      help="with --no_ssh: this node's index among the selected hosts, in hostfile order")
    a("--launcher", default="",
      help="local, ssh, slurm, openmpi, mpich, impi, mvapich or ray (default: slurm inside a SLURM allocation "
           "without --hostfile; else ssh when a host is remote, else local)")
    a("--launcher_args", default="", help="extra arguments for the launcher transport (ssh, srun, mpirun), verbatim")
    a("--ray_address", default=None, metavar="ADDR",
      help="with --launcher ray: the Ray cluster to run on (its head's host:port, or 'auto' on a node where "
           "'ray start' ran); default: start a local Ray cluster for the job")
    a("--module", action="store_true", help="run user_script as a module (python -m)")
    a("--no_python", action="store_true", help="run user_script directly, not through python")
    a("--no_local_rank", action="store_true", help="do not append --local_rank=N to the script arguments")
    a("--force_multi", action="store_true", help="use the multi-node launcher even for one host")
    a("--save_pid", action="store_true", help="write the launcher pid to /tmp/<pid>.deepspeed while running")
    a("--enable_each_rank_log", metavar="DIR", default=None,
      help="also write each rank's output to DIR/rank<N>.log")
    a("--bind_cores_to_rank", action="store_true",
      help="pin each worker to an equal share of the cores and set its OMP_NUM_THREADS")
    a("--bind_core_list", default="", help="cores to share out under --bind_cores_to_rank, e.g. '0-3,8'")
    a("--ssh_port", type=integer, default=None, help="SSH port of the hosts (default: ssh's)")
    a("--no_ssh_check", action="store_true",
      help="accepted for DeepSpeed compatibility; no effect: connecting to every host is dslaunch's "
           "SSH check")
    a("--venv_script", metavar="FILE", default=None,
      help="a shell script each SSH host sources before its node agent starts (a venv's bin/activate, "
           "module loads); the ssh launcher only")
    a("--log_level", choices=LEVELS, default="info",
      help="the launcher's own lines shown: info (default) also its notes, warning only restarts, host "
           "changes and stops, error only the failure line; worker output is never filtered")
    a("-q", "--quiet", action="store_true", help="--log_level error")
    a("--ssh_accept_new_host_keys", action="store_true",
      help="accept and remember unknown SSH host keys (default: reject unknown hosts)")
    a("--grace_period", type=real, default=DEFAULT_GRACE,
      help=f"seconds between SIGTERM and SIGKILL when stopping workers, 0-{MAX_GRACE:g} (default {DEFAULT_GRACE})")
    a("--hang_timeout", type=real, default=None, metavar="SECONDS",
      help="a rank whose training step does not advance for this long is hung: every rank's stacks "
           "go to the log dir, the job stops with exit code 124 (default: off; the first step gets "
           "at least 60 s)")
    a("--log_dir", default=None, metavar="DIR",
      help="where each job writes events.jsonl, per-rank error files and stack dumps, in DIR/<job id> "
           "(default $DSLAUNCH_LOG_DIR, else $XDG_STATE_HOME/dslaunch/logs or ~/.local/state/dslaunch/logs; "
           "'dslaunch status' shows the newest job there)")
    g = p.add_argument_group("restart and elasticity").add_argument
    g("--max_restarts", type=integer, default=None,
      help="restart the job up to N times after a failure (default 0)")
    g("--resume_from", metavar="DIR", default=None,
      help="a restarted run's initialize() loads the newest valid checkpoint in DIR (for scripts "
           "that never call engine.load_checkpoint)")
    g("--elastic_training", action="store_true",
      help="after a lost host, restart without it (needs --max_restarts)")
    g("--min_elastic_nodes", type=integer, default=-1,
      help="elastic: the fewest nodes to go on with (default 1)")
    g("--max_elastic_nodes", type=integer, default=-1,
      help="elastic: the most nodes to use (default: all selected hosts)")
    g("--no_warm_spares", action="store_true",
      help="with --max_restarts on one local node: start restarted workers fresh instead of handing "
           "them to spare interpreters kept with torch imported (about 250 MB each)")
    if "--autotuning" not in unsupported:
        a("--autotuning", choices=("tune", "run"), default=None,
          help="tune: search the ds_config's autotuning space, each experiment a dslaunch job on these hosts, "
               "and write the results and the best config; run: tune, then launch the job with the best")
    a("--dry-run", "--dry_run", dest="dry_run", action="store_true",
      help="print what would run on each host (command, environment) and exit")
    a("-v", "--verbose", action="store_true", help="show tracebacks for errors")
    a("--version", action="version", version=f"dslaunch {__version__}")
    p.add_argument_group("not supported yet", f"DeepSpeed launcher flags that are an error here: "
                         f"{', '.join(unsupported)}")
    for flag in unsupported:
        a(flag, action=_NotSupported)
    a("user_script", help="the training script (or module with --module, program with --no_python)")
    # argparse marks a REMAINDER positional required and names it in "the following arguments are
    # required", but a script needs no arguments.
    a("user_args", nargs=argparse.REMAINDER, help="arguments for the training script").required = False
    return p
