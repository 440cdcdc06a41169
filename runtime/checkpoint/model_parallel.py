"""Checkpoints of model-parallel engines: each rank's part, named by its topology coordinates.

Owns where a rank sits (``Placement``), the names of its files, what a model-parallel tag's
manifest records (``part_record``, ``tag_meta``) and its load plan (``read_parts``). A tag of an
engine with a pipeline (any ``PipelineModule``) or another model-parallel axis holds::

    zero_pipe_PP-data_DD-model_MM.dsl   the ZeRO strategy state of that rank (fp32 masters and
                                        optimizer state of its part: all ranks from stage 1, the
                                        data-parallel index 0 of each part at stage 0)
    layer_XX-model_states.dsl           a PipelineModule layer's buffers and untrained params under
                                        their module keys (``layer_XX-model_MM-...`` with a model
                                        axis), from each part's data-parallel index 0
    module_pipe_PP-model_MM.dsl         the same for a model-parallel engine that is no PipelineModule
                                        (for a PipelineModule: the keys of no layer, e.g. a loss
                                        module's buffers; absent when there are none)
    rank_NNNNN.dsl                      as in every tag (counters, RNG, client_state)

The manifest's ``model_parallel`` entry gives the topology and, per part (the coordinates
without ``data``), its files and ZeRO partition map. Loading reads its own part when the same
part exists with the same parameters (any data-parallel size and ZeRO stage: resharded over the
data axis as a plain checkpoint); otherwise, for a pipeline, each rank finds its parameters by
name in the parts that hold them (``reshard.by_name``): a tag saved at one pipeline depth loads at
another, and a plain (single-part) tag loads into a pipeline and back. AutoTP's parts record
their slices (``tensors``): their masters and optimizer state are joined and cut again for another
tensor-parallel degree (``reshard.by_slices``), and joined whole for ``zero_to_fp32``. The parts of
other model-parallel models (Megatron's tensor slices) may share names, so they load only at the
saving shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.checkpointer import MODULE_FILE, zero_file
from dslaunch.runtime.checkpoint.reshard import (
    assemble,
    by_name,
    by_slices,
    check_compatible,
    cut_slice,
    fp32_params,
    join_slices,
    needed_ranks,
    partition_map,
    partition_problem,
)
from dslaunch.runtime.checkpoint.store import CheckpointStore, Manifest

__all__ = ["Placement", "placement", "coord_name", "describe", "part_record", "tag_meta", "module_keys",
           "check_parts_meta", "read_parts", "consolidate_parts"]

_Files = dict[str, Any]


@dataclass(frozen=True)
class Placement:
    """Where this rank's part of a model-parallel model sits."""

    shape: dict[str, int]
    """Every axis' size (``pipe``, ``data``, ``model``), in topology order."""
    coord: dict[str, int]
    layers: dict[int, str] | None
    """A PipelineModule's layers on this rank: index -> key prefix; None for other models."""
    layer_count: int = 0
    tensors: dict[str, list] | None = None
    """AutoTP's slices on this rank (``name -> [dim, segments, whole size]``); None without AutoTP."""

    @property
    def part(self) -> str:
        return coord_name({a: c for a, c in self.coord.items() if a != "data"})

    @property
    def data(self) -> int:
        return self.coord.get("data", 0)


def placement(grid: Any, module: torch.nn.Module) -> Placement:
    """The placement of this rank in ``grid`` (a ``PipelineParallelGrid`` or a Megatron mpu)."""
    topo = grid.topology() if hasattr(grid, "topology") else None
    if topo is not None:
        coord = topo.get_coord(grid.get_global_rank())._asdict()
        shape = topo.shape()
    else:  # a Megatron-style mpu: a model axis and a data axis
        shape = {"model": grid.get_model_parallel_world_size(), "data": grid.get_data_parallel_world_size()}
        coord = {"model": grid.get_model_parallel_rank(), "data": grid.get_data_parallel_rank()}
    if hasattr(module, "checkpoint_layers"):  # a PipelineModule
        return Placement(dict(shape), dict(coord), module.checkpoint_layers(), module.num_layers)
    return Placement(dict(shape), dict(coord), None, tensors=getattr(module, "ds_tensor_layout", None))


def coord_name(coord: dict[str, int]) -> str:
    return "-".join(f"{axis}_{index:02d}" for axis, index in coord.items())


def describe(shape: dict[str, int] | None) -> str:
    """``pipe=2, data=1, model=1`` (None: a plain checkpoint, data-parallel only)."""
    if shape is None:
        return "no model parallelism"
    order = ["pipe", "data", "model"]  # a manifest's JSON keys come back sorted
    return ", ".join(f"{axis}={shape[axis]}" for axis in sorted(shape, key=lambda a: (a not in order,
                                                                                       order.index(a) if a in order else 0, a)))


def _layer_file(idx: int, place: Placement) -> str:
    model = f"-model_{place.coord['model']:02d}" if place.shape.get("model", 1) > 1 else ""
    return f"layer_{idx:02d}{model}-model_states.dsl"


# ---- save ---------------------------------------------------------------------------------------
def part_record(place: Placement, zero_sd: dict, layout: dict, module_sd: dict, in_groups: set[str],
                partitioned: bool) -> tuple[_Files, dict]:
    """This rank's files and the record of them the manifest is built from (all-gathered).

    Args:
        layout: ``zero_sd`` without tensors; ``in_groups``: params stored as fp32 masters.
    """
    files: _Files = {}
    record: dict[str, Any] = {"part": place.part, "coord": {a: c for a, c in place.coord.items() if a != "data"},
                              "data": place.data, "zero": None, "module_files": {}, "tensors": place.tensors}
    if partitioned or place.data == 0:
        name = f"zero_{coord_name(place.coord)}.dsl"
        files[name] = zero_sd
        record["zero"] = {"file": name, "layout": layout}
    if place.data == 0:
        kept = {k: v for k, v in module_sd.items() if k not in in_groups}
        groups = {} if place.layers is None else {_layer_file(i, place): [k for k in module_sd if k.startswith(p)]
                                                  for i, p in place.layers.items()}
        in_layers = {k for keys in groups.values() for k in keys}
        rest = [k for k in module_sd if k not in in_layers]  # another model's, or e.g. a loss module's buffers
        if rest or place.layers is None:
            groups[f"module_{place.part}.dsl"] = rest
        for name, keys in groups.items():
            files[name] = {"module": type(module_sd)((k, kept[k]) for k in keys if k in kept)}
            record["module_files"][name] = keys
    return files, record


def _module_order(key: str) -> tuple:
    """A PipelineModule's ``state_dict`` order at one stage: tied modules first, then by layer."""
    head = key.split(".", 1)[0]
    return (0, 0) if not head.isdigit() else (1, int(head))


def tag_meta(place: Placement, records: list[dict]) -> dict:
    """The manifest's ``model_parallel`` entry, from every rank's ``part_record``."""
    parts: dict[str, dict] = {}
    for rec in records:
        part = parts.setdefault(rec["part"], {"coord": rec["coord"], "zero_files": {}, "layouts": [],
                                              "module_files": {}})
        if rec.get("tensors"):
            part["tensors"] = rec["tensors"]
        if rec["zero"] is not None:
            part["zero_files"][str(rec["data"])] = rec["zero"]["file"]
            part["layouts"].append(rec["zero"]["layout"])
        part["module_files"].update(rec["module_files"])
    for part in parts.values():
        part["partition"] = partition_map(part.pop("layouts"))
    return {"shape": place.shape, "pipeline": place.layers is not None, "layer_count": place.layer_count,
            "parts": parts}


def module_keys(records: list[dict], pipeline: bool) -> list[str]:
    """Every module key of the tag once, in the one-stage model's order for a pipeline."""
    keys = list(dict.fromkeys(k for rec in records for names in rec["module_files"].values() for k in names))
    return sorted(keys, key=_module_order) if pipeline else keys


def check_parts_meta(meta: dict) -> str | None:
    """What is wrong with a manifest's ``model_parallel`` entry, or None."""
    mp = meta.get("model_parallel")
    if not (isinstance(mp, dict) and isinstance(mp.get("shape"), dict) and isinstance(mp.get("parts"), dict)
            and mp["parts"]):
        return "meta 'model_parallel' is malformed"
    for name, part in mp["parts"].items():
        if not (isinstance(part, dict) and isinstance(part.get("zero_files"), dict) and part["zero_files"]
                and isinstance(part.get("module_files"), dict) and isinstance(part.get("coord"), dict)):
            return f"meta 'model_parallel' part {name!r} is malformed"
        problem = partition_problem(part.get("partition"))
        if problem:
            return f"meta 'model_parallel' part {name!r}: partition {problem}"
        unnamed = {r for g in part["partition"]["groups"] for r in g["ranges"]} - set(part["zero_files"])
        if unnamed:
            return f"meta 'model_parallel' part {name!r} names no file for the shards of ranks {sorted(unnamed)[:3]}"
    return None


# ---- load ---------------------------------------------------------------------------------------
def _saved_parts(meta: dict) -> tuple[dict[str, dict], dict[str, int] | None, bool]:
    """The tag's parts, its shape (None: a plain tag) and whether names are unique across parts.

    A plain tag is one part: its ZeRO files by data-parallel rank and ``module.dsl``.
    """
    if "model_parallel" in meta:
        mp = meta["model_parallel"]
        # lowest stage first: a tied layer's copy is taken from there
        order = sorted(mp["parts"].items(), key=lambda kv: (kv[1]["coord"].get("pipe", 0), kv[1]["coord"].get("model", 0)))
        return dict(order), mp["shape"], bool(mp["pipeline"])
    pmap = meta["partition"]
    ranks = sorted({int(r) for g in pmap["groups"] for r in g["ranges"]}) or [0]
    whole = {"zero_files": {str(r): zero_file(r) for r in ranks}, "partition": pmap,
             "module_files": {MODULE_FILE: list(meta.get("module_keys", []))}}
    return {"": whole}, None, True


def _read_zero(store: CheckpointStore, tag: str, manifest: Manifest, part: dict,
               targets: list[tuple[int, int]]) -> dict:
    pmap = part["partition"]
    shards = [store.read(tag, part["zero_files"][str(r)], manifest) for r in needed_ranks(pmap, targets)]
    return assemble(shards, targets)


def _consolidated(store: CheckpointStore, tag: str, manifest: Manifest, part: dict) -> dict:
    return _read_zero(store, tag, manifest, part, [(0, int(g["numel"])) for g in part["partition"]["groups"]])


def _read_module(store: CheckpointStore, tag: str, manifest: Manifest, parts: dict[str, dict],
                 wanted: set[str] | None) -> dict:
    """The saved module entries (buffers, untrained params) among ``wanted`` keys (None: all),
    reading only the files that hold some of them (a pipeline's layer files)."""
    out: dict[str, Any] = {}
    for part in parts.values():
        for name, keys in part["module_files"].items():
            if wanted is None or wanted.intersection(keys):
                sd = store.read(tag, name, manifest)["module"]
                out.update((k, v) for k, v in sd.items() if (wanted is None or k in wanted) and k not in out)
    return out


def read_parts(store: CheckpointStore, tag: str, manifest: Manifest, current: dict,
               place: Placement | None, live_keys: set[str], source: str) -> dict:
    """What this rank loads from a model-parallel tag, or a plain tag into a model-parallel engine.

    Returns ``_read_plan``'s dict: ``module`` (the saved entries of this rank's ``live_keys``),
    and ``zero`` (this rank's strategy state), or ``incompatible`` (the error) and ``fp32``
    (the saved masters found by name) when the optimizer state cannot be mapped onto this engine.
    Raises CheckpointError for a missing, truncated or corrupt file.
    """
    meta = manifest.meta
    parts, shape, unique = _saved_parts(meta)
    here = place.shape if place is not None else None
    mine = parts.get(place.part) if place is not None and shape is not None else None
    targets = [(int(g["start"]), int(g["end"])) for g in current["groups"]]
    out: dict[str, Any] = {"module": _read_module(store, tag, manifest, parts, live_keys), "incompatible": None}
    if meta.get("model_parallel", {}).get("experts_by_rank"):  # each rank's experts differ: its own file
        return _own_experts(store, tag, manifest, mine if shape == here else None, place, current, source, out)
    if mine is not None:
        try:
            check_compatible(mine["partition"], current, source)
        except CheckpointError:
            mine = None  # the same part holds other layers: by name below
    if mine is not None:
        out["zero"] = _read_zero(store, tag, manifest, mine, targets)
        return out
    if _resliceable(parts, place):
        out["module"] = _module_slices(store, tag, manifest, parts, live_keys, place.tensors)  # type: ignore[union-attr]
        try:
            saved = by_slices([_consolidated(store, tag, manifest, p) for p in parts.values()],
                              [p["tensors"] for p in parts.values()], place.tensors)  # type: ignore[union-attr]
            out["zero"] = by_name([saved], current)
            return out
        except CheckpointError as exc:
            out["incompatible"] = CheckpointError(f"{exc} (saved at {describe(shape)}; this engine: {describe(here)})",
                                                  source)
            out["fp32"] = {}
            return out
    why = _refusal(meta, shape, unique, place)
    if not why:
        saved = [_consolidated(store, tag, manifest, p) for p in _relevant(parts, current)]
        try:
            out["zero"] = by_name(saved, current)
            return out
        except CheckpointError as exc:  # raised by by_name for a model that does not fit only
            why = str(exc)
    # Not an error yet: a tag of another model must not make the loader fall back to an older one.
    out["incompatible"] = CheckpointError(f"{why} (saved at {describe(shape)}; this engine: {describe(here)})",
                                          source)
    out["fp32"] = _masters(store, tag, manifest, parts) if unique else {}
    return out


def _own_experts(store: CheckpointStore, tag: str, manifest: Manifest, mine: dict | None, place: Placement | None,
                 current: dict, source: str, out: dict) -> dict:
    """A tag with expert parameters beside tensor slices: this rank's own ZeRO file, at the saving
    shape only (its experts are no other rank's); else ``out`` says why not (``incompatible``)."""
    own = mine["zero_files"].get(str(place.data)) if mine is not None and place is not None else None
    try:
        if own is None:
            raise CheckpointError("expert parameters beside model parallelism load only at the saving shape "
                                  f"(saved at {describe(manifest.meta['model_parallel']['shape'])}; this engine: "
                                  f"{describe(place.shape if place is not None else None)})", source)
        check_compatible(mine["partition"], current, source)  # type: ignore[index]
    except CheckpointError as exc:
        out.update(incompatible=exc, fp32={})
        return out
    out["zero"] = store.read(tag, own, manifest)
    return out


def _resliceable(parts: dict[str, dict], place: Placement | None) -> bool:
    """A tag of AutoTP slices (every part records its slices) into an AutoTP engine: its masters
    and optimizer state are joined and cut again (``reshard.by_slices``), whatever the two degrees."""
    return (place is not None and bool(place.tensors) and place.layers is None
            and all(p.get("tensors") for p in parts.values()))


def _relevant(parts: dict[str, dict], current: dict) -> list[dict]:
    """The saved parts holding any of the live parameters (the others are not read)."""
    names = {n for g in current["groups"] for n in g["names"]}
    return [p for p in parts.values() if any(names.intersection(g["names"]) for g in p["partition"]["groups"])]


def _refusal(meta: dict, shape: dict | None, unique: bool, place: Placement | None) -> str:
    """Why this tag's optimizer state cannot be mapped by name onto this engine ("" when it can)."""
    slices = place is not None and place.layers is None and place.shape.get("model", 1) * place.shape.get("pipe", 1) > 1
    if not unique or slices:
        return ("a model-parallel checkpoint of a model that is no PipelineModule loads only at its saving shape "
                f"(its parts may share parameter names): run at {describe(shape)}, or pass load_module_strict=False "
                "for the buffers only")
    saved_layers = meta["model_parallel"].get("layer_count") if shape is not None else None
    if place is not None and place.layers is not None and saved_layers and saved_layers != place.layer_count:
        return (f"the checkpoint's PipelineModule has {saved_layers} layers, this one {place.layer_count}: build it "
                f"from the same {saved_layers} layers (any number of stages)")
    return ""


def consolidate_parts(store: CheckpointStore, tag: str, manifest: Manifest, source: str
                      ) -> tuple[dict[str, torch.Tensor], dict]:
    """The fp32 masters (by name) and saved module entries of a whole model-parallel tag.

    Raises:
        CheckpointError: a tag of a model that is no PipelineModule (names may collide across parts).
    """
    parts, shape, unique = _saved_parts(manifest.meta)
    if shape is not None and all(p.get("tensors") for p in parts.values()):  # AutoTP slices: joined
        return _joined_masters(store, tag, manifest, parts), _module_slices(store, tag, manifest, parts, None, None)
    if not unique:
        raise CheckpointError(f"a model-parallel checkpoint of a model that is no PipelineModule ({describe(shape)}) "
                              "has no single state dict: its parts may share parameter names", source)
    return _masters(store, tag, manifest, parts), _read_module(store, tag, manifest, parts, None)


def _module_slices(store: CheckpointStore, tag: str, manifest: Manifest, parts: dict[str, dict],
                   wanted: set[str] | None, mine: dict | None) -> dict:
    """The saved module entries of an AutoTP tag (``wanted`` keys, None: all): a sliced one (a tied
    alias of a sliced parameter, a frozen slice) joined from every part, then cut to ``mine``'s
    slice (None: whole, in the model's own layout)."""
    layouts = [p["tensors"] for p in parts.values()]
    pieces: dict[str, list[Any]] = {}
    for part in parts.values():
        for name, keys in part["module_files"].items():
            if wanted is None or wanted.intersection(keys):
                for k, v in store.read(tag, name, manifest)["module"].items():
                    if wanted is None or k in wanted:
                        pieces.setdefault(k, []).append(v)
    out: dict[str, Any] = {}
    for key, values in pieces.items():
        if key not in layouts[0] or len(values) != len(layouts):
            out[key] = values[0]
            continue
        whole = join_slices(values, layouts, key)
        if mine is not None:
            out[key] = cut_slice(whole, mine[key]) if key in mine else whole
        else:
            out[key] = whole.t().contiguous() if len(layouts[0][key]) > 3 and layouts[0][key][3] else whole
    return out


def _joined_masters(store: CheckpointStore, tag: str, manifest: Manifest, parts: dict[str, dict]
                    ) -> dict[str, torch.Tensor]:
    """The whole model's fp32 masters from every AutoTP slice, in the model's own layout (a
    Conv1D weight transposed back to ``[in, out]``)."""
    layouts = [p["tensors"] for p in parts.values()]
    joined = fp32_params(by_slices([_consolidated(store, tag, manifest, p) for p in parts.values()], layouts, {}))
    return {name: (t.t().contiguous() if len(layouts[0].get(name, ())) > 3 and layouts[0][name][3] else t)
            for name, t in joined.items()}


def _masters(store: CheckpointStore, tag: str, manifest: Manifest, parts: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Every part's fp32 masters by name; a tied layer's from the lowest stage (parts are in that order)."""
    masters: dict[str, torch.Tensor] = {}
    for part in parts.values():
        for name, value in fp32_params(_consolidated(store, tag, manifest, part)).items():
            masters.setdefault(name, value)
    return masters


def whole_autotp(store: CheckpointStore, tag: str, manifest: Manifest
                 ) -> tuple[dict, dict[str, Any], dict[str, tuple[int, bool]]] | None:
    """An AutoTP tag's whole strategy state (every group's masters and optimizer state joined over
    the slices, in the sharded layers' layout), its module joined in the model's own layout, and
    per sliced parameter ``(dim, transposed)``: the dimension it is cut along and whether the model
    stores it transposed (GPT-2's ``Conv1D``). None: the tag is no AutoTP one (a pipeline's, an mpu's)."""
    parts, shape, _ = _saved_parts(manifest.meta)
    if shape is None or not all(p.get("tensors") for p in parts.values()) or manifest.meta["model_parallel"]["pipeline"]:
        return None
    layouts = [p["tensors"] for p in parts.values()]
    whole = by_slices([_consolidated(store, tag, manifest, p) for p in parts.values()], layouts, {})
    cuts = {name: (int(entry[0]), bool(len(entry) > 3 and entry[3])) for name, entry in layouts[0].items()}
    return whole, _module_slices(store, tag, manifest, parts, None, None), cuts
