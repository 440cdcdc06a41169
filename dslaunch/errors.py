"""Typed, user-facing errors shared by the launcher and the runtime.

Every error a user can cause (bad hostfile, config, flag or checkpoint) is a ``DslaunchError``
whose message alone says what is wrong and what would be valid: the CLI prints ``str(err)`` and
exits non-zero, with a traceback only under ``--verbose``.

The kinds follow torch.distributed.elastic's split:

- user errors: ``HostfileError``, ``ConfigError``, ``UsageError`` (bad input, fix and rerun);
- worker errors: ``WorkerFailedError`` (a rank exited non-zero or was killed),
  ``PipelineStageError`` (another pipeline stage stopped the batch);
- platform/infra errors: ``LaunchError`` (host unreachable, port busy, sshd refused);
- data errors: ``CheckpointError`` (missing, truncated or corrupt checkpoint on disk);
- ``NotInDslaunchError``: a DeepSpeed feature dslaunch lacks was used (``dslaunch/utils/refused.py``).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "DslaunchError",
    "UsageError",
    "LossScalingRequiredError",
    "NotALossError",
    "HostfileError",
    "ConfigError",
    "LaunchError",
    "WorkerFailedError",
    "PipelineStageError",
    "CheckpointError",
    "NotInDslaunchError",
    "SparsityConfigError",
    "TagMismatchError",
    "DeepSpeedConfigError",
    "BatchSizeError",
    "BucketAlignmentError",
    "did_you_mean",
    "quote",
    "shorten",
    "name_ranks",
    "install_excepthook",
    "CheckpointArgumentError",
    "CheckpointLayoutError",
    "ReshapeError",
    "UnconvertibleLayoutError",
    "ExpertShapeError",
    "SliceMetadataError",
    "NoSyncError",
    "AccumulationModeError",
    "AccumulationBoundaryError",
    "UntestedOptimizerError",
    "DtypeMixError",
]


class DslaunchError(Exception):
    """Base class: the message is complete and meant for the user."""

    exit_code: int = 1


class UsageError(DslaunchError, ValueError):
    """A command-line flag or argument is invalid.

    Also a ``ValueError``: what DeepSpeed's ``runner.main`` raises for conflicting flags."""

    exit_code = 2


class HostfileError(DslaunchError, ValueError):
    """A hostfile (or include/exclude filter) is invalid. Names the file and line.

    Also a ``ValueError``: what DeepSpeed's runner raises for a bad hostfile or filter."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        self.path, self.line = path, line
        super().__init__(f"{_where(path, line)}{message}")


def _where(path: str | None, line: int | None) -> str:
    """The ``file:line: `` prefix of file-format errors (or ``file: ``, or nothing)."""
    return f"{path}:{line}: " if path and line else (f"{path}: " if path else "")


class ConfigError(DslaunchError, ValueError):
    """A ds_config value is invalid. Names the key path, e.g. ``zero_optimization.stage``.

    Also a ``ValueError``: what DeepSpeed raises for a bad value, so callers that catch it keep working."""

    def __init__(self, message: str, key: str | None = None, source: str | None = None):
        self.key, self.source = key, source
        # Key paths are built from the user's keys: bounded and on one line like any quoted value.
        prefix = f"{shorten(source, 300)}: " if source else ""
        prefix += f"'{shorten(key, 120)}': " if key else ""
        super().__init__(f"{prefix}{message}")


DeepSpeedConfigError = ConfigError  # DeepSpeed's name (``deepspeed.DeepSpeedConfigError``)


class ModelRequiredError(ConfigError, AssertionError):
    """``initialize()`` without a model. Also an ``AssertionError``: what DeepSpeed raises there."""


class BatchSizeError(ConfigError, AssertionError):
    """The batch triad (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps``) cannot be completed or does not add up. Also an
    ``AssertionError``: what DeepSpeed's config raises there."""


class BucketAlignmentError(ConfigError, AssertionError):
    """``zero_optimization.allgather_bucket_size`` is odd at ZeRO stage 1 or 2. Also an
    ``AssertionError``: what DeepSpeed's stage 1/2 optimizer raises there."""


class DtypeMixError(ConfigError, NotImplementedError):
    """``data_types.grad_accum_dtype`` names a dtype dslaunch does not sum a model's gradients in.
    Also a ``NotImplementedError``: what DeepSpeed raises for an "unsupported mix"."""


class SparsityConfigError(UsageError, NotImplementedError):
    """A block-sparse attention layout or op was given arguments it cannot work with (a sequence
    length that is not a multiple of the block size, an unknown attention type, inputs of the wrong
    shape). Also a ``ValueError`` and a ``NotImplementedError``: what DeepSpeed's
    ``deepspeed.ops.sparse_attention`` raises there."""


class NoSyncError(UsageError, AssertionError):
    """``engine.no_sync()`` misused: nested, at ZeRO stage 2 or 3, or a boundary ``step()`` inside
    it. Also an ``AssertionError``: what DeepSpeed raises there."""


class AccumulationModeError(ConfigError, AssertionError):
    """``managed_gradient_accumulation: false`` with something that needs the engine to own the
    accumulation boundary (``overlap_comm`` at ZeRO stage 0 or 1, a ``PipelineModule``). Also an
    ``AssertionError``: what DeepSpeed raises there."""


class AccumulationBoundaryError(UsageError, AssertionError):
    """The accumulation boundary decided from two sides: ``set_gradient_accumulation_boundary()``
    or ``coalesce_grad_reduction()`` with ``managed_gradient_accumulation: false``, where every
    ``step()`` is the boundary. Also an ``AssertionError``: what DeepSpeed raises there."""


class LossScalingRequiredError(UsageError, RuntimeError):
    """A script's own ``loss.backward()`` under fp16 without ``engine.scale(loss)``: the gradients
    would be unscaled. Also a ``RuntimeError``: what DeepSpeed raises there."""


class NotALossError(UsageError, AssertionError):
    """``engine.scale(x)`` (or ``engine.backward(x)``) given something that is not a scalar loss
    with a graph. Also an ``AssertionError``: what DeepSpeed raises there."""


class UntestedOptimizerError(ConfigError, AssertionError):
    """A client optimizer ZeRO is not known to run exactly (not element-wise) without
    ``zero_allow_untested_optimizer``. Also an ``AssertionError``: what DeepSpeed raises there."""


class LaunchError(DslaunchError):
    """The job could not be started: host unreachable, port busy, interpreter missing."""

    def __init__(self, message: str, host: str | None = None):
        self.host = host
        super().__init__(f"{host}: {message}" if host else message)


class HostsError(LaunchError):
    """One or more hosts could not start their node agent. ``failures`` maps host -> (cause,
    message); the causes are the transport's (``SSHError``, ``SlurmError``) and preflight's
    (``interpreter``, ``cwd``, ``script``, ``version``, ``master``, ``port``)."""

    def __init__(self, failures: dict[str, tuple[str, str]]):
        self.failures = dict(failures)
        lines = [f"{host}: {msg}" for host, (_cause, msg) in sorted(self.failures.items())]
        if len(lines) == 1:
            super().__init__(lines[0])
        else:
            super().__init__(f"{len(lines)} hosts failed:\n  " + "\n  ".join(lines))


class WorkerFailedError(DslaunchError):
    """A worker exited non-zero or by a signal; the first failure is the root cause."""

    def __init__(self, message: str, rank: int, exit_code: int, host: str | None = None,
                 signal_name: str | None = None):
        self.rank, self.host, self.signal_name = rank, host, signal_name
        self.exit_code = exit_code
        super().__init__(message)


class PipelineStageError(DslaunchError):
    """Another pipeline stage stopped the batch mid-schedule; ``reason`` names that stage, its
    instruction and what it raised (``runtime/pipe``: the stage sends this instead of its messages)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"the pipeline batch stopped: {reason}")


class CheckpointError(DslaunchError):
    """A checkpoint on disk is missing, truncated, corrupt or incompatible. Names the file."""

    def __init__(self, message: str, path: str | None = None):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class NotInDslaunchError(DslaunchError, NotImplementedError):
    """A DeepSpeed feature dslaunch does not have was used (not merely imported): the message names
    it and what to use instead. Also a ``NotImplementedError``, which callers probing for optional
    features already catch."""


class CheckpointLayoutError(CheckpointError, RuntimeError):
    """A DeepSpeed checkpoint's files disagree about the parallel shape it was saved at (its
    ``checkpoint_parallel_dimensions``, its file counts). Also a ``RuntimeError``: what DeepSpeed's
    ``deepspeed.checkpoint`` raises there."""


class ExpertShapeError(CheckpointLayoutError, ValueError):
    """An AutoEP checkpoint's blocks hold another number of experts than the model's (its message
    gives DeepSpeed's ``target_local_experts=..., checkpoint_local_experts=...``). Also a
    ``ValueError``: what DeepSpeed's universal load raises there."""


class UnconvertibleLayoutError(CheckpointError, ValueError):
    """An AutoTP checkpoint holds a parameter whose split its layer could not describe (DeepSpeed's
    ``autotp_unsupported_parameter_patterns``), so it has no universal form. Also a ``ValueError``:
    what DeepSpeed's ``ds_to_universal`` raises there."""


class SliceMetadataError(CheckpointError, AssertionError):
    """An AutoTP checkpoint's slice records (shard widths, partition sizes, per-rank shapes) do not
    describe the tensors it holds, so joining or cutting them would misplace elements. Also an
    ``AssertionError``: what DeepSpeed's universal conversion and restore raise there."""


class ReshapeError(CheckpointError, ValueError):
    """A DeepSpeed checkpoint cannot be reshaped as asked (``DeepSpeedCheckpoint``'s target degrees:
    larger than the saved ones or not dividing them), or two of its states cannot be merged. Also a
    ``ValueError``: a bad argument."""


class CheckpointArgumentError(CheckpointError, ValueError):
    """A ``save_dir`` or tag a save or load cannot use (empty, not one directory name, ...).
    A ``ValueError`` too: DeepSpeed raises that for an empty ``save_dir``, and its tests expect it."""


class TagMismatchError(CheckpointError, AssertionError):
    """Ranks asked to save under different tags with ``checkpoint.tag_validation`` "Fail". Also an
    ``AssertionError``: what DeepSpeed raises there, so scripts that catch it keep working."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return " (did you mean 'x'?)" for the closest choice, or "" when none is close."""
    import difflib

    if len(word) > 200:  # no name is that long, and difflib's cost grows with it
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def shorten(text: str, limit: int = 80) -> str:
    """``text`` on one line (control characters escaped) and at most ``limit`` characters.

    For user input inside an error message: a file can hold a 16 MiB line or a U+2028 that a
    terminal or log reader would show as a line break.
    """
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def name_ranks(ranks: list[int], limit: int = 8) -> str:
    """``rank 3`` or ``ranks 0, 1 and 6 more``: at most ``limit`` numbers, for a message."""
    shown = ", ".join(map(str, ranks[:limit])) + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


class _BoundedRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 4, 4, 4
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 4
        self.maxstring, self.maxother, self.maxlong = 60, 60, 40

    def repr_int(self, x: int, level: int) -> str:
        # repr() itself refuses ints over 4300 digits (ValueError): count them instead.
        if x.bit_length() > 128:
            return f"<{math.floor(math.log10(abs(x))) + 1}-digit integer>"
        return super().repr_int(x, level)


_REPR = _BoundedRepr()


def quote(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message: bounded in size and depth, on one line.

    The one way errors show a user's value: a config value may be a huge or deeply nested
    structure, a 5000-digit integer, or a string holding line breaks.
    """
    return shorten(_REPR.repr(value), limit)


class EnvFileError(UsageError):
    """A ``.deepspeed_env`` / ``.dslaunch_env`` line is not ``KEY=VALUE``. Names the file and line."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        self.path, self.line = path, line
        super().__init__(f"{_where(path, line)}{message}")


def install_excepthook() -> None:
    """Show an uncaught ``DslaunchError`` in a worker as one line instead of a traceback.

    The error's message already names the file, key and what would be valid, so a traceback
    through the user's script and our internals only hides it. Other exceptions are untouched;
    ``DSLAUNCH_VERBOSE=1`` keeps the traceback. Idempotent: installs once per process.
    """
    import os
    import sys

    previous = sys.excepthook
    if getattr(previous, "_dslaunch", False):
        return

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        if issubclass(exc_type, DslaunchError) and not os.environ.get("DSLAUNCH_VERBOSE"):
            print(f"dslaunch: error: {exc}", file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    hook._dslaunch = True  # type: ignore[attr-defined]
    sys.excepthook = hook
