"""AutoTP checkpoints and DeepSpeed's universal layout: how one parameter's tensor-parallel slices
join into the whole tensor, and how a whole tensor is cut again for one tensor-parallel rank.

DeepSpeed describes an AutoTP model's splits in two places, both read here:

- ``universal_checkpoint_info`` (in every model-states file), for the conversion (``SliceRules``):
  patterns naming the parameters that are the same on every rank
  (``tp_replicated_parameter_patterns``), that are averaged, that are split along their input
  dimension (``parameter_with_row_parallelism_patterns``: joined on dim 1, every other split
  parameter on dim 0), fused sub-parameters (``parameter_with_sub_params``: a fused QKV whose Q, K
  and V are each split on their own; from layout version 0.4 each rank's width of each
  sub-parameter is recorded in ``sub_param_shard_widths``, which uneven GQA splits need), padded
  vocabularies, and the ``affine_map`` (each rank's pieces as strided views, applied by
  ``deepspeed_tp.joiner``), which supersedes the patterns where it names a parameter;
- a parameter's ``ds_autotp_universal_checkpoint_meta`` attribute (DeepSpeed's AutoTP layers set
  it), for the restore (``rank_slice``): ``partition_dim``, ``logical_shape``, ``partition_sizes``
  (an uneven split: the low ranks hold one more row), ``sub_param_sizes`` and
  ``sub_param_shard_widths``, ``replicated``.

Joining and cutting are each other's inverse, so a tag saved at one tensor-parallel degree is
restored at another. dslaunch's own AutoTP tags record their slices themselves
(``reshard.join_slices``); this module serves DeepSpeed's tags and ``deepspeed.checkpoint``'s names.

Limitations: an affine map's scaled pieces (DeepSpeed's ``scale``) are not applied; a layout a
layer could not describe (``autotp_unsupported_parameter_patterns``) is refused, as in DeepSpeed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import SliceMetadataError, UnconvertibleLayoutError
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    AFFINE_MAP,
    AFFINE_MAP_PARAMS,
    AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
    CAT_DIM,
    DS_AUTOTP_UC_META,
    ORIGINAL_VOCAB_SIZE,
    PARAM_N_SUB_PARAMS,
    PARAMETER_TO_AVERAGE_PATTERNS,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    SUB_PARAM_SHAPE,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCAB_TENSOR,
    VOCABULARY_PARAMETER_PATTERNS,
)

__all__ = ["SubparamShape", "SliceRules", "refuse_unsupported", "shapes_by_tp", "restore_meta", "rank_slice",
           "narrow_sub_params"]

_WIDTHS_VERSION = 0.4  # from this layout version on, fused sub-parameters record each rank's widths


@dataclass(frozen=True)
class SubparamShape:
    """DeepSpeed's description of a parameter made of sub-parameters (a fused QKV): the ``patterns``
    of the names it applies to, the ``shape`` (at ``partition_dim``: each sub-parameter's size, or
    in older checkpoints their count) and the dimension TP cuts (``partition_dim``)."""

    patterns: list[str]
    shape: tuple[tuple[int, ...] | int, ...]
    partition_dim: int


def refuse_unsupported(info: Mapping[str, Any], source: str | None = None) -> None:
    """Refuse a checkpoint whose layers split some parameter in a way they could not describe.

    Raises:
        UnconvertibleLayoutError: ``info`` lists ``autotp_unsupported_parameter_patterns`` (the
            patterns and reasons named).
    """
    unsupported = info.get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if unsupported:
        details = "; ".join(f"{pattern}: {reason}" for pattern, reason in sorted(unsupported.items()))
        raise UnconvertibleLayoutError(f"AutoTP universal checkpoint conversion is not supported for {details} "
                                       "(the layer could not describe its split): load the tag at the "
                                       "tensor-parallel degree it was saved at", source)


def shapes_by_tp(shapes_by_file: Sequence[Mapping[str, Any]], pp_degree: int, tp_degree: int
                 ) -> dict[str, list[Any]]:
    """Each parameter's shape on every tensor-parallel rank (None where the rank holds none), from
    the model-states files' ``param_shapes``, given pipeline-major (file ``i`` is stage
    ``i // tp_degree``, tensor rank ``i % tp_degree``, as DeepSpeed numbers them). A parameter of
    one stage only is kept; one in several stages (a tied weight) must have one shape.

    Raises:
        SliceMetadataError: the count of files is not ``pp_degree * tp_degree``, or pipeline
            replicas of a parameter disagree on shape.
    """
    if len(shapes_by_file) != pp_degree * tp_degree:
        raise SliceMetadataError(f"{len(shapes_by_file)} model-states files for pp_degree {pp_degree} x "
                                 f"tp_degree {tp_degree}")
    per_rank: list[dict[str, Any]] = []
    for tp in range(tp_degree):
        merged: dict[str, Any] = {}
        for pp in range(pp_degree):
            for name, shape in shapes_by_file[pp * tp_degree + tp].items():
                if name in merged and tuple(merged[name]) != tuple(shape):
                    raise SliceMetadataError(f"pipeline replicas of {name!r} on tensor-parallel rank {tp} disagree on "
                                             f"shape: {tuple(merged[name])} vs {tuple(shape)}")
                merged[name] = shape
        per_rank.append(merged)
    names = dict.fromkeys(name for shapes in per_rank for name in shapes)
    return {name: [shapes.get(name) for shapes in per_rank] for name in names}


def _sizes(spec: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in spec) if isinstance(spec, (tuple, list)) else (int(spec),)


def _even_widths(name: str, sizes: Sequence[int], tp: int, version: float) -> list[list[int]]:
    """The only split recoverable without recorded widths: every sub-parameter cut evenly."""
    uneven = [s for s in sizes if s % tp]
    if uneven:
        raise SliceMetadataError(f"sub-parameter sizes {uneven} of {name} are not divisible by tp_world_size {tp}, "
                                 f"and the checkpoint (universal layout version {version}) records no "
                                 f"{SUB_PARAM_SHARD_WIDTHS}: its uneven split cannot be reconstructed")
    return [[s // tp] * tp for s in sizes]


def _check_widths(name: str, sizes: Sequence[int], widths: Sequence[Sequence[int]], tp: int) -> None:
    if len(widths) != len(sizes):
        raise SliceMetadataError(f"{len(widths)} shard-width entries for the {len(sizes)} sub-parameters of {name}")
    for size, per_rank in zip(sizes, widths, strict=True):
        if len(per_rank) != tp or sum(per_rank) != size:
            raise SliceMetadataError(f"shard widths {list(per_rank)} of a sub-parameter of {name} do not cut its "
                                     f"{size} rows over {tp} tensor-parallel ranks")


def _resolve(shape: list[int], numel: int, name: str) -> list[int]:
    """``shape`` with its one ``-1`` placeholder resolved for ``numel`` elements."""
    holes = [i for i, d in enumerate(shape) if d < 0]
    if not holes:
        return shape
    known = math.prod(d for d in shape if d >= 0)
    if len(holes) > 1 or known <= 0 or numel % known:
        raise SliceMetadataError(f"sub-parameter shape {shape} of {name} does not fit its {numel} elements")
    return [numel // known if d < 0 else d for d in shape]


def _as_subparam_shape(entry: Any) -> SubparamShape:
    if isinstance(entry, Mapping):
        return SubparamShape(list(entry["patterns"]), tuple(entry["shape"]), int(entry["partition_dim"]))
    return SubparamShape(list(entry.patterns), tuple(entry.shape), int(entry.partition_dim))


@dataclass(frozen=True)
class SliceRules:
    """A checkpoint's ``universal_checkpoint_info``: how each parameter's slices join (module
    docstring). ``merge`` joins one parameter; ``patterns`` are all the category patterns, which
    a strict conversion requires each to name some parameter."""

    replicated: tuple[str, ...] = ()
    averaged: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    vocabulary: tuple[str, ...] = ()
    two_sub_params: tuple[str, ...] = ()
    sub_params: tuple[SubparamShape, ...] = ()
    shard_widths: Mapping[str, Any] | None = None
    affine: Mapping[str, Any] | None = None
    version: float = 0.0
    original_vocab_size: int | None = None

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> SliceRules:
        """The rules of ``universal_checkpoint_info`` (an empty one: every split joined on dim 0)."""
        def listed(key: str) -> tuple[str, ...]:
            return tuple(info.get(key) or ())

        vocab = info.get(ORIGINAL_VOCAB_SIZE)
        return cls(listed(TP_REPLICATED_PARAMETER_PATTERNS), listed(PARAMETER_TO_AVERAGE_PATTERNS),
                   listed(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS), listed(VOCABULARY_PARAMETER_PATTERNS),
                   listed(PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0),
                   tuple(_as_subparam_shape(s) for s in info.get(PARAMETER_WITH_SUB_PARAMS) or ()),
                   dict(info.get(SUB_PARAM_SHARD_WIDTHS) or {}), dict((info.get(AFFINE_MAP) or {}).get(
                       AFFINE_MAP_PARAMS) or {}), float(info.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0)),
                   int(vocab) if vocab is not None else None)

    def patterns(self) -> set[str]:
        """Every category pattern (the affine map's are apart: they name only what they map)."""
        found = {*self.replicated, *self.averaged, *self.row, *self.vocabulary, *self.two_sub_params}
        return found | {p for s in self.sub_params for p in s.patterns}

    def merge(self, name: str, slices: Sequence[torch.Tensor], tp_degree: int
              ) -> tuple[torch.Tensor | None, dict[str, Any], set[str]]:
        """The whole ``name`` from its ``slices`` (one per tensor-parallel rank, each in its own
        shape), the keys DeepSpeed stores beside it (``cat_dim``, ``sub_param_shape``,
        ``vocab_tensor``, ...) and the patterns that named it. ``(None, {}, ...)``: no slices
        (ZeRO kept no optimizer state for a parameter that never had a gradient).

        Raises:
            SliceMetadataError: ``name`` matches several patterns of one kind, replicated slices
                differ, or the sub-parameter records do not describe the slices.
        """
        used: set[str] = set()

        def named_by(patterns: Sequence[str]) -> bool:
            hits = [p for p in patterns if re.match(p, name)]
            if len(hits) > 1:
                raise SliceMetadataError(f"{name!r} matches several patterns of one kind: {hits}")
            used.update(hits)
            return bool(hits)

        if not slices:
            return None, {}, used
        sub = next(((s, p) for s in self.sub_params for p in s.patterns if re.match(p, name)), None)
        mapped = [p for p in self.affine or {} if re.match(p, name)]
        extras: dict[str, Any] = {}
        if len(mapped) > 1:
            raise SliceMetadataError(f"{name!r} matches several affine-map patterns: {mapped}")
        if mapped:  # the map says where every element lies: the patterns it supersedes count as used
            from dslaunch.runtime.checkpoint.deepspeed_tp import joiner

            for kind in (self.replicated, self.averaged, self.row, self.vocabulary, self.two_sub_params):
                named_by(kind)
            used.update([sub[1]] if sub else [])
            whole = joiner({mapped[0]: (self.affine or {})[mapped[0]]}, Path(name))(name, list(slices))
            return whole, extras, used
        if named_by(self.replicated):
            if any(not torch.equal(slices[0], s) for s in slices[1:]):
                raise SliceMetadataError(f"{name!r} is listed in {TP_REPLICATED_PARAMETER_PATTERNS}, but its "
                                         "tensor-parallel ranks hold different values")
            whole = slices[0]
        elif named_by(self.averaged):
            whole = sum(slices[1:], slices[0]) / len(slices)
        elif named_by(self.two_sub_params):
            halves = [s.chunk(2, dim=0) for s in slices]
            whole = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            extras = {CAT_DIM: 0, PARAM_N_SUB_PARAMS: 2}
        elif sub is not None:
            used.add(sub[1])
            whole, normalized = self._join_sub_params(name, sub[0], sub[1], slices, tp_degree)
            extras = {SUB_PARAM_SHAPE: normalized}
        else:
            dim = 1 if named_by(self.row) else 0
            whole = torch.cat(list(slices), dim=dim)
            extras = {CAT_DIM: dim}
        if named_by(self.vocabulary):
            if self.original_vocab_size is None:
                raise SliceMetadataError(f"{name!r} is a vocabulary parameter, but the checkpoint records no "
                                         f"{ORIGINAL_VOCAB_SIZE} to strip its padding to")
            whole = whole[:self.original_vocab_size]
            extras[VOCAB_TENSOR] = True
        return whole, extras, used

    def _widths(self, name: str, shape: SubparamShape, pattern: str, slices: Sequence[torch.Tensor], tp: int
                ) -> tuple[tuple[int, ...], list[list[int]], SubparamShape]:
        """Each sub-parameter's whole size, each rank's width of it, and ``shape`` with the sizes
        at ``partition_dim`` (an old checkpoint's count of equal sub-parameters decoded)."""
        dim, spec = shape.partition_dim, shape.shape[shape.partition_dim]
        if self.version >= _WIDTHS_VERSION:
            widths = (self.shard_widths or {}).get(pattern)
            if widths is None:  # the head counts that decide them are in the model's config, not here
                raise SliceMetadataError(f"universal checkpoint version {self.version} records no "
                                         f"{SUB_PARAM_SHARD_WIDTHS} for {name}, whose pattern {pattern} declares "
                                         "sub-parameters")
            return _sizes(spec), [list(w) for w in widths], shape
        if isinstance(spec, (tuple, list)):
            sizes, normalized = _sizes(spec), shape
        else:
            if any(s.dim() <= dim for s in slices):
                raise SliceMetadataError(f"{name}: an old sub-parameter count needs each rank's slice shape, the "
                                         "slices are flat")
            full, count = sum(s.shape[dim] for s in slices), int(spec)
            if count <= 0 or full % count:
                raise SliceMetadataError(f"{name}: {count} sub-parameters do not divide its {full} rows")
            sizes = (full // count,) * count
            decoded = list(shape.shape)
            decoded[dim] = sizes
            normalized = SubparamShape(list(shape.patterns), tuple(decoded), dim)
        return sizes, _even_widths(name, sizes, tp, self.version), normalized

    def _join_sub_params(self, name: str, shape: SubparamShape, pattern: str, slices: Sequence[torch.Tensor],
                         tp: int) -> tuple[torch.Tensor, SubparamShape]:
        sizes, widths, normalized = self._widths(name, shape, pattern, slices, tp)
        _check_widths(name, sizes, widths, tp)
        dim = shape.partition_dim
        logical = [sum(d) if isinstance(d, (tuple, list)) else int(d) for d in shape.shape]
        logical[dim] = sum(sizes)
        # resolved from the whole: a rank holding none of a sub-parameter cannot infer the -1
        logical = _resolve(logical, sum(s.numel() for s in slices), name)
        views = []
        for rank, piece in enumerate(slices):
            mine = list(logical)
            mine[dim] = sum(w[rank] for w in widths)
            if math.prod(mine) != piece.numel():
                raise SliceMetadataError(f"tensor-parallel rank {rank} of {name} holds {piece.numel()} elements, its "
                                         f"recorded shard widths describe {tuple(mine)}")
            views.append(piece.reshape(mine))
        offsets, chunks = [0] * len(views), []
        for per_rank in widths:
            chunks.append(torch.cat([v.narrow(dim, offsets[r], per_rank[r]) for r, v in enumerate(views)], dim=dim))
            offsets = [o + w for o, w in zip(offsets, per_rank, strict=True)]
        return torch.cat(chunks, dim=dim), normalized


def restore_meta(param: Any) -> dict[str, Any] | None:
    """The restore side of a parameter's AutoTP record (``ds_autotp_universal_checkpoint_meta``:
    its top-level keys; ``conversion`` holds what the conversion used), or None."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def narrow_sub_params(full: torch.Tensor, dim: int, sizes: Sequence[int], widths: Sequence[Sequence[int]] | None,
                      tp_rank: int, tp_world_size: int, version: float, name: str = "the parameter") -> torch.Tensor:
    """Rank ``tp_rank``'s piece of every sub-parameter of ``full`` (split along ``dim``), joined,
    flat; ``widths``: each sub-parameter's per-rank widths (None before layout version 0.4: even).

    Raises:
        SliceMetadataError: the sizes do not sum to the dimension, the widths are missing (version
            0.4 on) or inconsistent, or an old checkpoint's sub-parameter is not evenly divisible.
    """
    if sum(sizes) != full.shape[dim]:
        raise SliceMetadataError(f"sub-parameter sizes {list(sizes)} of {name} sum to {sum(sizes)}, its dimension "
                                 f"{dim} is {full.shape[dim]}: the record describes another parameter")
    if version < _WIDTHS_VERSION:
        widths = _even_widths(name, sizes, tp_world_size, version)
    elif widths is None:
        raise SliceMetadataError(f"{name} records no {SUB_PARAM_SHARD_WIDTHS} (universal layout version {version})")
    _check_widths(name, sizes, widths, tp_world_size)
    pieces, offset = [], 0
    for size, per_rank in zip(sizes, widths, strict=True):
        pieces.append(full.narrow(dim, offset + sum(per_rank[:tp_rank]), per_rank[tp_rank]))
        offset += size
    return torch.cat(pieces, dim=dim).flatten()


def _affine_cut(entry: Mapping[str, Any], full: torch.Tensor, tp_rank: int) -> torch.Tensor | None:
    """Rank ``tp_rank``'s shard from an affine-map entry (``deepspeed_tp.joiner`` reversed), or None
    when the map does not describe this tensor for that rank."""
    ranks = entry.get("ranks") or {}
    plan = ranks.get(tp_rank, ranks.get(str(tp_rank)))
    if plan is None or math.prod(entry.get("logical_shape", ())) != full.numel():
        return None
    whole = full.reshape(tuple(entry["logical_shape"])).contiguous()
    shard = whole.new_empty(tuple(plan["shard_shape"]))
    for piece in plan["pieces"]:
        (src, src_strides), (dst, dst_strides) = piece["source"], piece["dest"]
        shard.as_strided(piece["shape"], dst_strides, dst).copy_(whole.as_strided(piece["shape"], src_strides, src))
    return shard.flatten()


def rank_slice(meta: Mapping[str, Any] | None, full: torch.Tensor, tp_rank: int, tp_world_size: int
               ) -> torch.Tensor | None:
    """Rank ``tp_rank``'s slice (flat) of the universal tensor ``full`` as the parameter's AutoTP
    record ``meta`` describes it; None where the record says nothing (the caller's ``cat_dim``
    rules apply).

    Raises:
        UnconvertibleLayoutError: the record says the layer could not describe its split.
        SliceMetadataError: the record does not fit ``full`` (an uneven split without
            ``partition_sizes``, sub-parameter widths missing or inconsistent).
    """
    if not meta:
        return None
    conversion = meta.get("conversion") or {}
    if conversion.get("unsupported_reason"):
        raise UnconvertibleLayoutError("cannot restore a universal checkpoint into this AutoTP parameter: "
                                       f"{conversion['unsupported_reason']}")
    if conversion.get(AFFINE_MAP) is not None:
        cut = _affine_cut(conversion[AFFINE_MAP], full, tp_rank)
        if cut is not None:
            return cut
    if meta.get("replicated", False):
        return full.flatten()
    dim, logical = meta.get("partition_dim"), meta.get("logical_shape")
    if dim is None or logical is None:
        return None
    view = full.view(tuple(logical))
    sizes = meta.get("sub_param_sizes")
    if sizes is None and meta.get("sub_param_shape") is not None:
        spec = meta["sub_param_shape"]
        if hasattr(spec, "shape") and hasattr(spec, "partition_dim"):
            spec, dim = spec.shape, spec.partition_dim
        sizes = spec[dim]  # older records: the sizes at the partition dimension
    version = float(meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
    if sizes is not None:
        return narrow_sub_params(view, dim, _sizes(sizes), meta.get("sub_param_shard_widths"), tp_rank,
                                 tp_world_size, version)
    partition = meta.get("partition_sizes")
    if partition is not None:
        return view.narrow(dim, sum(partition[:tp_rank]), partition[tp_rank]).flatten()
    # AutoTP gives the remainder to the low ranks, torch.chunk to none (10 over 4: 3,3,2,2 vs 3,3,3,1)
    if view.shape[dim] % tp_world_size:
        raise SliceMetadataError(f"dimension {dim} of size {view.shape[dim]} is not divisible by tp_world_size "
                                 f"{tp_world_size}, and this checkpoint records no partition_sizes, so its uneven "
                                 "split cannot be reconstructed")
    return view.chunk(tp_world_size, dim=dim)[tp_rank].flatten()
