"""Weights for ``init_inference``: where they come from, and filling a model shard by shard.

- ``empty_init()``: build a model whose parameters are on the meta device (no memory); buffers
  (rotary tables, masks) stay real, since checkpoints do not hold the non-persistent ones.
- ``open_checkpoint(spec, base_dir)``: a ``WeightSource`` for DeepSpeed's checkpoint description
  (``{"type": "ds_model", "checkpoints": [...], "version": 1.0}``, as a dict or a JSON file), a
  Hugging Face directory or index (``model.safetensors``, ``pytorch_model.bin``, sharded with
  ``*.index.json``), one weights file, dslaunch's engine checkpoints (a save_dir or a tag) and
  ``zero_to_fp32`` output.
- ``read`` of a source returns only the requested ranges of one dimension: safetensors files are
  sliced on disk, torch files are memory-mapped, so a rank reads about its own 1/tp.

Limitations: an engine checkpoint is consolidated in memory on every rank first (its ZeRO
shards are flat across parameters); export it with ``dslaunch zero-to-fp32`` to load by slices.
Megatron-style per-rank checkpoint files (DeepSpeed's ``"parallelization": "tp"``) are refused.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dslaunch.errors import CheckpointError, UsageError, shorten
from dslaunch.textfile import Fail, check_file, read_head, read_json

__all__ = ["empty_init", "WeightSource", "ModuleSource", "DictSource", "FileSource", "open_checkpoint",
           "take_segments", "has_meta"]

Segments = tuple[tuple[int, int], ...]


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Parameters registered inside are created on the meta device (allocated one at a time, then
    dropped); buffers are kept. ``init_inference`` fills them from its ``checkpoint``."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def take_segments(tensor: torch.Tensor, dim: int | None, segments: Segments | None) -> torch.Tensor:
    """``tensor``'s ``segments`` along ``dim`` (all of it for None), as a new contiguous tensor."""
    if dim is None or segments is None:
        return tensor.detach().clone()
    return torch.cat([tensor.narrow(dim, a, b - a) for a, b in segments], dim=dim).contiguous()


class WeightSource(Protocol):
    """Named tensors that can be read in slices."""

    def names(self) -> set[str]: ...

    def read(self, name: str, dim: int | None = None, segments: Segments | None = None) -> torch.Tensor: ...


class DictSource:
    """An in-memory state dict (a module's own tensors, a consolidated engine checkpoint)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], origin: str):
        self._tensors, self.origin = dict(tensors), origin

    def names(self) -> set[str]:
        return set(self._tensors)

    def read(self, name: str, dim: int | None = None, segments: Segments | None = None) -> torch.Tensor:
        return take_segments(self._tensors[name], dim, segments)


class ModuleSource(DictSource):
    """The model's own (real) parameters and buffers, tied ones under every name."""

    def __init__(self, model: nn.Module):
        tensors = {n: t for n, t in model.named_parameters(remove_duplicate=False) if t.device.type != "meta"}
        tensors.update((n, t) for n, t in model.named_buffers(remove_duplicate=False) if t.device.type != "meta")
        super().__init__(tensors, "the model's own weights")


class FileSource:
    """Weights files (safetensors sliced on disk; torch files memory-mapped)."""

    def __init__(self, files: list[Path], origin: str):
        self.origin = origin
        self._where: dict[str, Any] = {}  # name -> open safetensors handle or loaded torch dict
        for path in files:
            if not path.exists():
                raise CheckpointError("is listed as a checkpoint file but does not exist", str(path))
            table = _open_file(path)
            for key in table.keys():  # noqa: SIM118 (safetensors handles have keys(), not iteration)
                self._where.setdefault(key, table)

    def names(self) -> set[str]:
        return set(self._where)

    def read(self, name: str, dim: int | None = None, segments: Segments | None = None) -> torch.Tensor:
        table = self._where[name]
        if isinstance(table, dict):
            return take_segments(table[name], dim, segments)
        if dim is None or segments is None:
            return table.get_tensor(name)
        part = table.get_slice(name)
        index = [slice(None)] * (dim + 1)
        pieces = []
        for a, b in segments:
            index[dim] = slice(a, b)
            pieces.append(part[tuple(index)])
        return torch.cat(pieces, dim=dim).contiguous()


DESCRIPTION_MAX_BYTES = 64 * 2**20
"""A checkpoint description or ``*.index.json``: a list of files, or one line per tensor (a few MiB
for the largest models)."""
SAFETENSORS_HEADER_MAX_BYTES = 100_000_000
"""The safetensors library's own limit on a header."""


def _fail_for(path: Path) -> Fail:
    return lambda message, line: CheckpointError(f"line {line}: {message}" if line else message, str(path))


def _open_file(path: Path) -> Any:
    check_file(path, None, _fail_for(path))  # a FIFO or a device is no weights file
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            _check_safetensors_header(path)
            return safe_open(str(path), framework="pt", device="cpu")
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors' SafetensorError is no OSError: name the file
        raise CheckpointError(f"cannot read weights ({type(err).__name__}: {shorten(str(err), 200)})",
                              str(path)) from None
    if isinstance(state, Mapping) and "module" in state and isinstance(state["module"], Mapping):
        state = state["module"]  # DeepSpeed's mp_rank_00_model_states.pt layout
    if not isinstance(state, Mapping):
        raise CheckpointError("holds no state dict", str(path))
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


_WEIGHT_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "model.safetensors",
                 "pytorch_model.bin")


def _check_safetensors_header(path: Path) -> None:
    """A safetensors file starts with its header's length (8 bytes, little-endian) and the header
    (a JSON object): check both, bounded, so a corrupt file is named (the library's error is not)."""
    fail = _fail_for(path)
    head, size = read_head(path, 8, fail)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= min(SAFETENSORS_HEADER_MAX_BYTES, size - 8):
        raise CheckpointError(f"not a safetensors file: its header length ({length if length >= 0 else 'none'}) "
                              f"does not fit its {size} bytes (corrupt or truncated)", str(path))
    header, _ = read_head(path, 8 + length, fail)
    try:
        parsed = json.loads(header[8:])
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise CheckpointError("not a safetensors file: its header is not a JSON object (corrupt)", str(path))


def _read_description(path: Path) -> Any:
    """A checkpoint description or index (JSON), bounded; a JSON object or CheckpointError."""
    desc = read_json(path, DESCRIPTION_MAX_BYTES, _fail_for(path))
    if not isinstance(desc, dict):
        raise CheckpointError("expected a JSON object (a checkpoint description or *.index.json)", str(path))
    return desc


def _index_files(index: Path) -> list[Path]:
    weight_map = _read_description(index).get("weight_map", {})
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError("'weight_map' must map tensor names to file names", str(index))
    return [index.parent / f for f in dict.fromkeys(weight_map.values())]


def _description_files(desc: Mapping[str, Any], base_dir: Path) -> list[Path]:
    """The files of DeepSpeed's checkpoint description (full weights only)."""
    if desc.get("parallelization") == "tp" or str(desc.get("type", "")).lower() == "megatron":
        raise UsageError("checkpoint: per-rank (Megatron / 'parallelization': 'tp') checkpoints are not supported by "
                         "dslaunch's init_inference; give the full weights (e.g. a zero_to_fp32 export)")
    files = desc.get("checkpoints")
    if isinstance(files, Mapping):  # {"non_tp": [...], "tp": [...]} in newer descriptions
        files = [*files.get("non_tp", []), *files.get("tp", [])]
    if not isinstance(files, list) or not files:
        raise UsageError("checkpoint: a checkpoint description needs 'checkpoints': a list of weights files "
                         "(DeepSpeed's format: {\"type\": \"ds_model\", \"checkpoints\": [...], \"version\": 1.0})")
    return [base_dir / f for f in files]


def _is_engine_checkpoint(path: Path) -> bool:
    from dslaunch.runtime.checkpoint.store import LATEST, MANIFEST

    return (path / LATEST).is_file() or (path / MANIFEST).is_file() or any(
        (p / MANIFEST).is_file() for p in path.iterdir() if p.is_dir())


def _directory(path: Path) -> WeightSource:
    if _is_engine_checkpoint(path):
        from dslaunch.runtime.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint

        return DictSource(get_fp32_state_dict_from_zero_checkpoint(path), f"engine checkpoint {path}")
    for name in _WEIGHT_FILES:
        found = path / name
        if found.is_file():
            return FileSource(_index_files(found) if name.endswith(".json") else [found], str(path))
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise CheckpointError("holds no weights (no engine checkpoint, *.safetensors, pytorch_model.bin or "
                              "*.index.json)", str(path))
    return FileSource(files, str(path))


def open_checkpoint(spec: str | Mapping[str, Any], base_dir: str | None = None) -> WeightSource:
    """The weights named by ``init_inference``'s ``checkpoint`` (see the module docstring).

    Raises:
        CheckpointError: a missing or unreadable path; UsageError: a description it cannot load.
    """
    if isinstance(spec, Mapping):
        return FileSource(_description_files(spec, Path(base_dir or ".")), "checkpoint description")
    path = Path(spec)
    if path.is_dir():
        return _directory(path)
    if not path.exists():
        raise CheckpointError("does not exist (checkpoint: a description JSON, a directory or a weights file)",
                              str(path))
    if path.suffix == ".json":
        desc = _read_description(path)
        if "weight_map" in desc:
            return FileSource(_index_files(path), str(path))
        return FileSource(_description_files(desc, Path(base_dir or path.parent)), str(path))
    return FileSource([path], str(path))
