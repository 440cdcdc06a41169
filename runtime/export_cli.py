"""The command line of ``dslaunch zero-to-fp32``, ``python -m dslaunch.utils.zero_to_fp32`` and
``python -m dslaunch.utils.zero_to_torch`` (DeepSpeed 0.19.8's, which adds a required ``--dtype``),
and every check of its arguments that needs no torch, in one place all read.

``check_arguments`` answers a bad flag, a checkpoint directory that is missing or no directory, a
malformed or absent tag, a directory without any checkpoint and an output that cannot be written
as asked, each in one line, before ``runtime.checkpoint.export`` (torch, ~1-2 s) is imported: the
click command and ``run_as_script`` call it first. The export reads the same functions, so the early
answer is the one the export would give. Lives in the runtime (which never imports the launcher),
since ``runtime.checkpoint.export`` uses it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dslaunch.errors import CheckpointError, DslaunchError, UsageError
from dslaunch.runtime.checkpoint.deepspeed_layout import is_deepspeed_folder
from dslaunch.runtime.checkpoint.store import MANIFEST, CheckpointStore, validate_tag

__all__ = ["parser", "check_arguments", "check_output", "no_checkpoint", "open_source", "is_single_file",
           "run_as_script", "FILE_SUFFIXES"]

FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


# DeepSpeed's spellings of the output dtypes (``zero_to_torch --dtype``)
DTYPE_NAMES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")


def parser(with_dtype: bool = False) -> argparse.ArgumentParser:
    """The command line of ``dslaunch zero-to-fp32`` (and ``python -m dslaunch.utils.zero_to_fp32``);
    ``with_dtype``: ``zero_to_torch``'s, whose ``--dtype`` is required."""
    p = argparse.ArgumentParser(
        prog="zero_to_torch" if with_dtype else "dslaunch zero-to-fp32",
        description=f"Write one consolidated {'float32, float16 or bfloat16' if with_dtype else 'fp32'} state "
                    "dict from a checkpoint (dslaunch's or DeepSpeed's) saved at any world size and ZeRO stage.")
    if with_dtype:
        p.add_argument("--dtype", required=True, choices=DTYPE_NAMES, help="the floating tensors' output dtype")
    p.add_argument("checkpoint_dir", help="the save_dir of save_checkpoint, or a tag directory in it")
    p.add_argument("output", help="a directory (pytorch_model.bin, or shards plus "
                   "pytorch_model.bin.index.json, as DeepSpeed writes), or one file ending in .bin, "
                   ".pt, .pth or .safetensors (e.g. model.safetensors)")
    p.add_argument("--max_shard_size", default=None, help="directory output: largest shard, e.g. 500MB (default 5GB)")
    p.add_argument("--safe_serialization", action="store_true",
                   help="directory output: write model.safetensors (needs safetensors)")
    p.add_argument("-t", "--tag", default=None, help="tag to convert (default: latest)")
    p.add_argument("--exclude_frozen_parameters", action="store_true",
                   help="leave out parameters saved with requires_grad=False")
    p.add_argument("-d", "--debug", action="store_true",
                   help="DeepSpeed's flag, accepted: dslaunch prints what it wrote and from which tag either way")
    return p


def check_arguments(argv: list[str] | None, with_dtype: bool = False) -> argparse.Namespace:
    """Parse ``argv`` (``parser(with_dtype)``'s command line) and refuse what the export would refuse
    before reading any weights.

    Raises:
        SystemExit: from argparse (``--help``, a bad flag: its usage message, code 2).
        CheckpointError, UsageError: one line naming the path, tag or flag.
    """
    args = parser(with_dtype).parse_args(argv)
    single = check_output(Path(args.output), args.safe_serialization)
    if args.max_shard_size is not None and single:
        raise UsageError(f"--max_shard_size shards a directory output; {args.output} names one file")
    store, tag = open_source(args.checkpoint_dir, args.tag)
    if tag is not None:
        if not is_deepspeed_folder(store.root / tag):
            store.manifest(tag)  # a missing tag or manifest, named as the export names it
    elif not (found := store.candidates())[0]:
        raise no_checkpoint(store, found[1])
    return args


def open_source(checkpoint_dir: str | os.PathLike, tag: str | None) -> tuple[CheckpointStore, str | None]:
    """The store and tag ``checkpoint_dir`` names: a ``save_dir``, or a tag directory itself."""
    path = Path(checkpoint_dir)
    if tag is not None:
        validate_tag(str(tag))  # '../..' would read outside the checkpoint directory
    try:
        if not path.is_dir():
            raise CheckpointError("not a directory (expected a save_dir or one of its tag directories)",
                                  str(path))
        if (path / MANIFEST).is_file() and tag is None:  # a tag directory itself
            return CheckpointStore(path.parent), path.name
    except OSError as exc:
        raise CheckpointError(f"cannot read the directory ({exc.strerror or exc})", str(path)) from exc
    return CheckpointStore(path), tag


def no_checkpoint(store: CheckpointStore, notes: list[str]) -> CheckpointError:
    """No tag to try in ``store``; ``notes`` say why ``latest`` was not usable."""
    return CheckpointError("no checkpoint here (" + ("; ".join(notes) or "no tags") + ")", str(store.root))


def is_single_file(output: Path) -> bool:
    """True for a path naming one weights file (``model.pt``) rather than an output directory."""
    return not output.is_dir() and output.suffix in FILE_SUFFIXES


def check_output(output: Path, safe_serialization: bool) -> bool:
    """Refuse an output the export cannot write as asked; returns whether it is one file."""
    try:
        single = is_single_file(output)
        exists_not_dir = not single and output.exists() and not output.is_dir()
    except OSError as err:
        raise UsageError(f"cannot use the output {output}: {err.strerror or err}") from None
    if single and safe_serialization and output.suffix != ".safetensors":
        raise UsageError(f"{output}: safe_serialization writes safetensors; name the file *.safetensors "
                         "or give a directory")
    if exists_not_dir:
        raise UsageError(f"{output}: exists and is not a directory; give a directory, or a file name "
                         f"ending in {', '.join(FILE_SUFFIXES)}")
    return single


def run_as_script(argv: list[str] | None = None, with_dtype: bool = False) -> None:
    """``python -m`` entry (``with_dtype``: ``zero_to_torch``'s): the arguments checked first, then the
    export; errors print as one line with the error's exit code."""
    try:
        args = check_arguments(argv, with_dtype)
        from dslaunch.runtime.checkpoint.export import run

        code = run(args)
    except DslaunchError as err:
        print(f"{'zero_to_torch' if with_dtype else 'zero-to-fp32'}: error: {err}", file=sys.stderr)
        code = err.exit_code
    sys.exit(code)
