"""``dslaunch zero-to-fp32 CHECKPOINT_DIR OUTPUT``: one consolidated fp32 state dict from a checkpoint.

Owns the offline export, with DeepSpeed's ``deepspeed.utils.zero_to_fp32`` API (also importable
as ``dslaunch.utils.zero_to_fp32``): the ZeRO shards of any world size and stage are
concatenated into full fp32 master weights and split per parameter; buffers and parameters the
optimizer did not hold (frozen ones) come from the saved module file. The result is a plain
``{name: tensor}`` dict in the module's ``state_dict`` order, loadable with ``model.load_state_dict``.

Output is DeepSpeed's layout: a directory holding ``pytorch_model.bin`` (``model.safetensors``
with ``safe_serialization``), or, past ``max_shard_size``, shards
``pytorch_model-00001-of-00003.bin`` ... plus ``pytorch_model.bin.index.json``. A path ending in
``.bin``, ``.pt``, ``.pth`` or ``.safetensors`` that is not an existing directory is written as
that one file instead (format from the suffix, never sharded).

Resuming training never needs this step: ``engine.load_checkpoint`` reshards at load time.

Limitations: ``lazy_mode`` returns ordinary tensors (they answer ``.contiguous()`` like
DeepSpeed's lazy ones); ``exclude_frozen_parameters`` needs a checkpoint that records its frozen
parameters, or one saved with ``exclude_frozen_parameters=True`` (a buffer and a frozen
parameter look alike in the saved module file).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError, UsageError, shorten
from dslaunch.runtime.checkpoint.checkpointer import MODULE_FILE, zero_file
from dslaunch.runtime.checkpoint.deepspeed_layout import is_deepspeed_folder
from dslaunch.runtime.checkpoint.deepspeed_read import read_deepspeed
from dslaunch.runtime.checkpoint.experts import whole_experts
from dslaunch.runtime.checkpoint.model_parallel import consolidate_parts
from dslaunch.runtime.checkpoint.reshard import assemble, check_meta, expert_groups, fp32_params, needed_ranks
from dslaunch.runtime.checkpoint.store import (
    LATEST,
    MANIFEST,
    CheckpointStore,
    first_loadable,
    summary,
    write_atomic,
)
from dslaunch.runtime.export_cli import (
    check_arguments,
    check_output,
    no_checkpoint,
    open_source,
    run_as_script,
)
from dslaunch.safe_write import explain

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_state_dict",
           "convert_zero_checkpoint_to_fp32_state_dict", "load_state_dict_from_zero_checkpoint", "main"]

StateDict = OrderedDict[str, torch.Tensor]

log = logging.getLogger("dslaunch.checkpoint")

_SIZE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # decimal, as Hugging Face
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# ---- reading ------------------------------------------------------------------------------------
def _frozen(meta: dict, module: dict, source: str) -> set[str]:
    """Names of the frozen parameters in the saved module file (to leave out of the export)."""
    if meta.get("exclude_frozen_parameters"):
        return set()  # saved without them
    if "frozen_parameters" in meta:
        return set(meta["frozen_parameters"])
    held = [k for k, v in module.items() if torch.is_tensor(v)]
    if held:
        # Not a broken tag (no fallback to an older one): the request does not fit this checkpoint.
        raise UsageError(
            f"{source}: cannot leave out frozen parameters: this checkpoint does not record which of the "
            f"tensors in its module file ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}) are "
            "frozen parameters and which are buffers; convert without exclude_frozen_parameters, or "
            "save with engine.save_checkpoint(..., exclude_frozen_parameters=True)")
    return set()


def _deepspeed_state(folder: Path, exclude_frozen: bool) -> StateDict:
    """A tag in DeepSpeed's layout (DeepSpeed's own, or ``checkpoint.format: "deepspeed"``): the
    module's tensors with each trained parameter's fp32 master in its place."""
    ds = read_deepspeed(folder)  # no engine: stage 0 gives the module's weights (its masters)
    if exclude_frozen and ds.stage == 0:
        raise UsageError(f"{folder}: cannot leave out frozen parameters: a DeepSpeed checkpoint without ZeRO "
                         "does not record which parameters were trained; convert without exclude_frozen_parameters")
    buffers = set(ds.states.get("buffer_names") or ())
    out: StateDict = OrderedDict()
    for name, value in ds.module.items():
        value = ds.fp32.get(name, value)
        frozen = name not in ds.fp32 and name not in buffers
        if torch.is_tensor(value) and not (exclude_frozen and frozen):
            out[name] = value.float().clone() if value.is_floating_point() else value.clone()
    return _tied(out, ds.states.get("shared_params"))


def _tied(out: StateDict, shared: dict[str, str] | None) -> StateDict:
    """Each further name of a tied parameter gets its first name's tensor, the one object (its fp32
    master, not the 16-bit copy the module file kept), as DeepSpeed's export ties them."""
    for alias, first in (shared.items() if isinstance(shared, dict) else ()):
        if isinstance(first, str) and alias in out and first in out and out[alias].shape == out[first].shape:
            out[alias] = out[first]
    return out


def _consolidate(store: CheckpointStore, tag: str, exclude_frozen: bool) -> StateDict:
    if is_deepspeed_folder(store.root / tag):
        return _deepspeed_state(store.root / tag, exclude_frozen)
    manifest = store.manifest(tag)
    check_meta(manifest.meta, str(store.root / tag / MANIFEST))
    if "model_parallel" in manifest.meta:  # every part's masters, a pipeline's layer files
        masters, module = consolidate_parts(store, tag, manifest, str(store.root / tag))
    else:
        pmap = manifest.meta["partition"]
        experts = expert_groups(pmap)
        if experts and "experts" not in manifest.meta:  # every expert rank's parameters have the same names
            raise CheckpointError(f"the checkpoint holds expert parameters ({experts[0]}), whose values differ by "
                                  "expert rank under one name, and no record of which is which (saved by an "
                                  "older dslaunch): load the tag with the engine at the layout it was saved",
                                  str(store.root / tag))
        dense = [gi for gi, g in enumerate(pmap["groups"]) if "reduce_group" not in g]
        dense_map = {**pmap, "groups": [pmap["groups"][gi] for gi in dense]}
        full = [(0, int(g["numel"])) for g in dense_map["groups"]]
        shards = [store.read(tag, zero_file(r), manifest) for r in needed_ranks(dense_map, full)] if full else []
        masters = fp32_params(assemble([{**sd, "groups": [sd["groups"][gi] for gi in dense]} for sd in shards],
                                       full)) if full else OrderedDict()
        if experts:  # each global expert under its own number (DeepSpeed's checkpoint keys)
            masters.update(whole_experts(lambda r: store.read(tag, zero_file(r), manifest), manifest.meta))
        module = store.read(tag, MODULE_FILE, manifest)["module"]
    skip = _frozen(manifest.meta, module, str(store.root / tag)) if exclude_frozen else set()
    out: StateDict = OrderedDict()
    for name in manifest.meta.get("module_keys", list(module)):  # the module's state_dict order
        if name in masters:
            out[name] = masters.pop(name)
        elif name not in skip and torch.is_tensor(module.get(name)):
            value = module[name]
            out[name] = value.float().clone() if value.is_floating_point() else value.clone()
    out.update(masters)
    return _tied(out, manifest.meta.get("shared_params"))


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> StateDict:
    """The consolidated fp32 state dict of a checkpoint (any world size, ZeRO stage 0-3).

    Args:
        checkpoint_dir: the ``save_dir`` given to ``save_checkpoint``, or one tag directory.
        tag: which tag; None: the one ``latest`` names, else the newest valid one.
        exclude_frozen_parameters: leave out parameters saved with ``requires_grad=False``
            (buffers stay).
        lazy_mode: accepted for DeepSpeed compatibility; the tensors are returned loaded (their
            ``.contiguous()`` is what DeepSpeed's lazy tensors return).
    Returns:
        ``{name: tensor}`` in the module's ``state_dict`` order; floating tensors in fp32.
    Raises:
        CheckpointError naming the directory or the missing/corrupt file; UsageError for
        ``exclude_frozen_parameters`` on a checkpoint that does not record its frozen parameters.
    """
    tag, state, passed_over = _resolve(checkpoint_dir, tag, exclude_frozen_parameters)
    _warn_fallback(tag, passed_over)
    return state


def _resolve(checkpoint_dir: str | os.PathLike, tag: str | None,
             exclude_frozen: bool) -> tuple[str, StateDict, list[str]]:
    """The tag consolidated, its state dict, and why newer tags (or ``latest``) were passed over."""
    store, tag = open_source(checkpoint_dir, tag)
    if tag is not None:
        return tag, _consolidate(store, tag, exclude_frozen), []
    tags, notes = store.candidates()
    found = first_loadable(tags, lambda t: _consolidate(store, t, exclude_frozen))
    if found is None:
        raise no_checkpoint(store, notes)
    latest_given = os.path.lexists(store.root / LATEST)  # without one, the newest tag is no fallback
    return found[0], found[1], (notes if latest_given else []) + found[2]


def _fallback_line(tag: str, passed_over: list[str]) -> str:
    """Exporting an older tag bit for bit looks like success: say which and why."""
    return f"exported tag {tag!r}, the newest valid one: {summary(passed_over)}"


def _warn_fallback(tag: str, passed_over: list[str]) -> None:
    if passed_over:
        log.warning("zero_to_fp32: %s", _fallback_line(tag, passed_over))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's consolidated fp32 weights into it.

    As DeepSpeed's: the model is no longer usable by the engine that trained it. Frozen
    parameters the checkpoint left out keep their current values.

    Returns:
        ``model`` (on the CPU).
    Raises:
        CheckpointError: unreadable checkpoint, or its names do not match the model (checked
            before anything is loaded; DeepSpeed loads what matches silently).
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    expected = set(model.state_dict())
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    missing = sorted(expected - set(state) - frozen)
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint does not fit the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}", str(checkpoint_dir))
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


# ---- writing ------------------------------------------------------------------------------------
def _output_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise UsageError(f"dtype: expected float32, float16 or bfloat16 (a torch dtype or a name), got {dtype!r}")


def _shard_limit(max_shard_size: Any) -> int | None:
    """Bytes per shard from ``max_shard_size``: None, a number of bytes, or e.g. "5GB", "500MB"."""
    if max_shard_size is None:
        return None
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool) and max_shard_size > 0:
        return max_shard_size
    if isinstance(max_shard_size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?B)?\s*", max_shard_size, re.IGNORECASE)
        if match and float(match[1]) > 0:
            return int(float(match[1]) * _SIZE_UNITS[(match[2] or "").upper()])
    raise UsageError(f"max_shard_size: expected a size such as \"5GB\" or \"500MB\", a number of bytes, "
                     f"or None for one file; got {max_shard_size!r}")


def _require_safetensors(where: Path) -> None:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise UsageError(f"{where}: writing safetensors needs the safetensors package "
                         "(pip install safetensors), or write the torch format (.bin/.pt)") from None


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, a copy for each further name of a tied one: safetensors refuses
    tensors that share memory."""
    seen: set[int] = set()
    out = {}
    for name, value in state.items():
        out[name] = value.clone() if id(value) in seen else value.contiguous()
        seen.add(id(value))
    return out


def _write(state: dict[str, torch.Tensor], output: Path) -> None:
    if output.suffix == ".safetensors":
        from safetensors.torch import save_file

        # "format": "pt" is what transformers checks before loading a safetensors file.
        write_atomic(output, lambda tmp: save_file(_unshared(state), str(tmp), metadata={"format": "pt"}))
    else:
        write_atomic(output, lambda tmp: torch.save(state, tmp))


def _split(state: StateDict, limit: int | None) -> list[list[str]]:
    """Names per shard, in state order: a shard is closed before the tensor that would take it
    past ``limit`` bytes (a tensor larger than ``limit`` gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_directory(state: StateDict, out: Path, weights: str, limit: int | None) -> list[Path]:
    """DeepSpeed's (Hugging Face's) layout: one weights file, or shards plus an index."""
    stem, suffix = weights.split(".", 1)
    shards = _split(state, limit)
    names = [weights] if len(shards) == 1 else [f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}"
                                                 for i in range(1, len(shards) + 1)]
    for name, keys in zip(names, shards, strict=True):
        _write({k: state[k] for k in keys}, out / name)
    index = out / f"{weights}.index.json"
    written = [out / n for n in names]
    if len(shards) > 1:
        body = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                "weight_map": {k: n for n, keys in zip(names, shards, strict=True) for k in keys}}
        write_atomic(index, lambda tmp: tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n"))
        written.append(index)
    # Shards or an index left by an earlier export would make loaders mix old and new weights.
    stale = [*out.glob(f"{stem}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].{suffix}"), index]
    for path in stale:
        if path not in written and path.is_file():
            path.unlink()
    return written


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                          dtype: Any = torch.float32, max_shard_size: int | str | None = "5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the consolidated state dict, floating tensors cast to ``dtype``, in DeepSpeed's layout.

    Args:
        output_dir: a directory (created if needed), or a path ending in .bin/.pt/.pth/.safetensors
            to write exactly that one file (format from the suffix, never sharded).
        dtype: float32, float16 or bfloat16, as a torch dtype or a name.
        max_shard_size: largest shard in a directory, e.g. "5GB", "500MB", bytes, or None.
        safe_serialization: write safetensors (``model.safetensors``) instead of ``torch.save``.
    Returns:
        The files written (weights, then the index when sharded).
    Raises:
        UsageError: bad ``dtype``/``max_shard_size``, safetensors missing or contradicting a file
            name; CheckpointError as ``get_fp32_state_dict_from_zero_checkpoint``.
    """
    files, tag, passed_over = _export(checkpoint_dir, output_dir, dtype, max_shard_size, safe_serialization, tag,
                                      exclude_frozen_parameters)
    _warn_fallback(tag, passed_over)
    return files


def _export(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, dtype: Any,
            max_shard_size: int | str | None, safe_serialization: bool, tag: str | None,
            exclude_frozen_parameters: bool) -> tuple[list[Path], str, list[str]]:
    """``convert_zero_checkpoint_to_state_dict``, also returning the tag written and why newer
    ones were passed over."""
    cast, limit, output = _output_dtype(dtype), _shard_limit(max_shard_size), Path(output_dir)
    single = check_output(output, safe_serialization)
    if (output.suffix == ".safetensors") if single else safe_serialization:
        _require_safetensors(output)
    tag, state, passed_over = _resolve(checkpoint_dir, tag, exclude_frozen_parameters)
    state = OrderedDict((k, v.to(cast) if v.is_floating_point() else v) for k, v in state.items())
    try:
        if single:
            _write(state, output)
            return [output], tag, passed_over
        weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
        return _write_directory(state, output, weights, limit), tag, passed_over
    except OSError as err:
        raise UsageError(f"cannot write {explain(err, output)}") from None
    except RuntimeError as err:  # torch.save reports a failed write (e.g. a full disk) this way
        raise UsageError(f"cannot write {output}: the write failed with {_free_mb(output):.1f} MB free on "
                         f"its file system ({shorten(str(err).splitlines()[0] if str(err) else '', 120)})"
                         ) from None


def _free_mb(output: Path) -> float:
    """Free space where ``output`` goes (its nearest existing ancestor), in MB; -1 when unknown."""
    path = output
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free / 1e6
    except OSError:
        return -1.0


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike,
                                               output_dir: str | os.PathLike,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[Path]:
    """``convert_zero_checkpoint_to_state_dict`` in fp32 (DeepSpeed's signature)."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


# ---- command line -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``dslaunch zero-to-fp32 CHECKPOINT_DIR OUTPUT [options]``; DslaunchError on bad input."""
    return run(check_arguments(argv))


def run(args: argparse.Namespace) -> int:
    """The export ``args`` (from ``export_cli.check_arguments``, already checked) ask for."""
    files, tag, passed_over = _export(args.checkpoint_dir, args.output, getattr(args, "dtype", torch.float32),
                                      args.max_shard_size or "5GB", args.safe_serialization, args.tag,
                                      args.exclude_frozen_parameters)
    if passed_over:
        print(f"zero-to-fp32: warning: {_fallback_line(tag, passed_over)}", file=sys.stderr)
    size = sum(f.stat().st_size for f in files) / 1e6
    print(f"wrote {files[0] if len(files) == 1 else f'{len(files)} files to {files[0].parent}'} "
          f"({size:.1f} MB) from tag {tag!r}")
    return 0


if __name__ == "__main__":
    run_as_script()
