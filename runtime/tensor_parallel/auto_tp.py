"""AutoTP: which Linear layers to shard how, found from the model's dataflow and shapes.

``plan_tensor_parallel`` runs the model once on a tiny input (on the meta device when its
weights are there: no memory, no FLOPs) and records, for every ``Linear`` / ``Conv1D``, which
other Linears its input was computed from since the last normalization layer (or embedding):

- a Linear fed by no other Linear (its input is a norm's output: q/k/v, gate/up, fc1, fused qkv)
  is a *producer*; one fed only by producers (o/out/dense, down/fc2) is a *consumer*;
- each consumer and the producers feeding it form a group: producers are sharded column-wise,
  the consumer row-wise (one all-reduce after it). A producer that feeds no consumer and is as
  wide as the vocabulary (``lm_head``) is split over the vocabulary and its logits gathered;
  other such producers (a pooler, a classifier) stay whole on every rank, as do norms;
- an ``nn.Embedding`` with as many rows as the vocabulary is split over its rows (the same split
  as the output layer: a tied ``lm_head`` holds the same shard); its partial embeddings are summed
  by one all-reduce. Smaller embeddings (positions, token types) stay whole;
- the split follows attention heads when the consumer's input width is ``heads * head_dim``
  (from the model's config): q and o by query heads, k and v by KV heads (GQA: each rank takes
  whole KV groups, unevenly when the count does not divide; fewer KV heads than ranks replicates
  each KV head over the ranks of its group), a fused qkv by heads in its layout (GPT-NeoX
  interleaves q,k,v per head; others concatenate q|k|v); other groups (MLPs) split evenly.

Integer attributes of the attention modules that hold a head count or width (``num_heads``,
``split_size``, ``all_head_size``...) are set to this rank's values, so the model's own forward
runs unchanged. ``injection_policy`` ({block class: row-parallel Linear names}) overrides the
dataflow for the blocks it names.

Limitations: the model must run on a ``input_ids`` tensor (Hugging Face-style) for the trace,
or come with an ``injection_policy``. An embedding subclass with its own ``forward`` (Gemma's
scaled one) is not split, nor then an ``lm_head`` tied to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from dslaunch.errors import UsageError

__all__ = ["ShardSpec", "TPPlan", "plan_tensor_parallel", "is_linear", "head_plan", "linear_shape", "config_heads",
           "local_attributes", "is_head_norm"]

Segments = tuple[tuple[int, int], ...]  # [start, stop) ranges of one dimension, in order


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or GPT-2's ``Conv1D`` (a Linear with its weight stored ``[in, out]``)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of a Linear or Conv1D (whatever device its weight is on)."""
    out, inp = module.weight.shape
    return (inp, out) if not isinstance(module, nn.Linear) else (out, inp)


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    return type(module).__name__.endswith(("LayerNorm", "RMSNorm", "Norm"))


def is_head_norm(module: nn.Module, hidden: int | None) -> bool:
    """A norm narrower than the model's ``hidden`` size: it normalizes each head (Qwen3's
    ``q_norm`` / ``k_norm`` over ``head_dim``), so with the heads split each slice's gradient of its
    weight is a part of the whole one."""
    weight = getattr(module, "weight", None)
    return (hidden is not None and _is_norm(module) and isinstance(weight, torch.Tensor)
            and 0 < weight.numel() < hidden)


def _is_reset(module: nn.Module, hidden: int | None = None) -> bool:
    """Normalizations and embeddings start a new dataflow segment (their output is nobody's split);
    a per-head norm (``is_head_norm``) keeps its input's segment, so q and k stay in o's group."""
    return isinstance(module, nn.Embedding) or (_is_norm(module) and not is_head_norm(module, hidden))


@dataclass(frozen=True)
class ShardSpec:
    """One Linear's share on one rank: ``column`` and ``vocab`` keep ``segments`` of the output
    features, ``row`` keeps ``segments`` of the input features."""

    name: str
    kind: str  # "column" | "row" | "vocab" (column, then gathered: every rank gets all logits) | "embedding"
    segments: Segments
    widths: tuple[int, ...] = ()  # "vocab": every rank's number of output features, in rank order


@dataclass(frozen=True)
class TPPlan:
    """What to do on one rank: the Linears to shard and the attributes to set to local values."""

    shards: tuple[ShardSpec, ...]
    attributes: tuple[tuple[str, str, int], ...]  # (module name, attribute, local value)
    replicated: tuple[str, ...]  # Linears kept whole, for the log line


class _DataflowMode(TorchFunctionMode):
    """Tags every tensor with the set of Linears it was computed from (since the last reset)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, frozenset[str]] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while tracing

    def tag(self, value: Any) -> frozenset[str]:
        leaves, _ = tree_flatten(value)
        return frozenset().union(*(self.tags.get(id(t), frozenset()) for t in leaves if isinstance(t, torch.Tensor)))

    def set(self, value: Any, tag: frozenset[str]) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                self.tags[id(t)] = tag
                self._alive.append(t)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tag = self.tag((args, kwargs))
        if tag:
            self.set(out, tag | self.tag(out))
        return out


def _record_input(inputs: dict[str, frozenset[str]], mode: _DataflowMode, name: str, module: nn.Module,
                  args: tuple) -> None:
    inputs.setdefault(name, mode.tag(args))  # the first call (a Linear reused later keeps its first role)


def trace_producers(model: nn.Module, example: Mapping[str, torch.Tensor]) -> dict[str, frozenset[str]]:
    """For each Linear that ran: the Linears its input came from (empty: a producer)."""
    mode = _DataflowMode()
    inputs: dict[str, frozenset[str]] = {}
    handles = []
    for name, module in model.named_modules():
        if is_linear(module):
            handles.append(module.register_forward_pre_hook(partial(_record_input, inputs, mode, name)))
            handles.append(module.register_forward_hook(
                lambda m, args, out, name=name: mode.set(out, frozenset({name}))))
        elif _is_reset(module, getattr(getattr(model, "config", None), "hidden_size", None)):
            handles.append(module.register_forward_hook(lambda m, args, out: mode.set(out, frozenset())))
    try:
        with torch.no_grad(), mode:
            model(**example)
    finally:
        for h in handles:
            h.remove()
    return inputs


@dataclass(frozen=True)
class Heads:
    """The attention geometry from the model's config."""

    heads: int
    kv_heads: int
    head_dim: int


def config_heads(model: nn.Module) -> Heads | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    heads = next((getattr(config, k) for k in ("num_attention_heads", "n_head", "num_heads")
                  if isinstance(getattr(config, k, None), int)), None)
    hidden = next((getattr(config, k) for k in ("hidden_size", "n_embd", "d_model")
                   if isinstance(getattr(config, k, None), int)), None)
    if heads is None or hidden is None:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return Heads(heads, kv, head_dim)


def _even(n: int, parts: int) -> list[range]:
    """``range(n)`` in ``parts`` contiguous pieces, the first ones one longer when it does not divide."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def head_plan(heads: int, kv_heads: int, tp: int) -> list[tuple[list[int], list[int]]]:
    """Per rank: (query heads, KV heads). Whole GQA groups stay on one rank (uneven if they must);
    with fewer KV heads than ranks, each KV head is repeated on the ranks sharing its group.

    Raises:
        UsageError: a split that would cut a query head or leave a rank without one.
    """
    if heads % kv_heads:
        raise UsageError(f"tensor_parallel: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    group = heads // kv_heads
    if kv_heads >= tp:
        return [([q for kv in kvs for q in range(kv * group, (kv + 1) * group)], list(kvs)) for kvs in _even(kv_heads, tp)]
    per_kv = tp // kv_heads
    if tp % kv_heads or group % per_kv:
        raise UsageError(f"tensor_parallel.tp_size={tp} cannot split {heads} query heads over {kv_heads} KV heads: "
                         f"use a tp_size that divides {kv_heads}, or a multiple of it that divides {heads}")
    plan = []
    for rank in range(tp):
        kv = rank // per_kv
        part = _even(group, per_kv)[rank % per_kv]
        plan.append(([kv * group + q for q in part], [kv]))
    return plan


def _segments(units: list[int], width: int, offset: int = 0) -> Segments:
    """Contiguous ranges covering units ``u`` (each ``width`` wide, from ``offset``), merged."""
    out: list[list[int]] = []
    for u in units:
        start = offset + u * width
        if out and out[-1][1] == start:
            out[-1][1] = start + width
        else:
            out.append([start, start + width])
    return tuple((a, b) for a, b in out)


@dataclass(frozen=True)
class _Group:
    consumer: str
    producers: tuple[str, ...]


def _groups(producers_of: Mapping[str, frozenset[str]]) -> list[_Group]:
    """Consumers fed only by producers (Linears fed by none), each with its producers."""
    sources = {n for n, fed_by in producers_of.items() if not fed_by}
    return [_Group(n, tuple(sorted(fed_by))) for n, fed_by in producers_of.items()
            if fed_by and fed_by <= sources]


def _policy_groups(model: nn.Module, policy: Mapping[Any, Any],
                   producers_of: Mapping[str, frozenset[str]]) -> list[_Group]:
    """``injection_policy``: in each named block class, the listed Linears are row-parallel and the
    other Linears of the block that feed them column-parallel (without a trace: those registered
    between the previous row Linear and this one, as q/k/v before o and gate/up before down)."""
    groups = []
    for block_name, block in model.named_modules():
        rows = next((tuple(v) for k, v in policy.items()
                     if (isinstance(k, type) and isinstance(block, k)) or k == type(block).__name__), None)
        if rows is None:
            continue
        prefix = f"{block_name}." if block_name else ""
        linears = [f"{prefix}{n}" for n, m in block.named_modules() if n and is_linear(m)]
        row_names = {f"{prefix}{r}" for r in rows}
        missing = row_names - set(linears)
        if missing:
            raise UsageError(f"injection_policy: {type(block).__name__} has no Linear {sorted(missing)[0]!r}; its "
                             f"Linears are {', '.join(n[len(prefix):] for n in linears)}")
        pending: list[str] = []  # without a trace: each other Linear feeds the next row Linear after it
        for name in linears:
            if name not in row_names:
                pending.append(name)
                continue
            fed_by = producers_of.get(name) or frozenset(pending)
            groups.append(_Group(name, tuple(sorted(fed_by & (set(linears) - row_names)))))
            pending = []
    return groups


def _fused_layout(model: nn.Module) -> str:
    """How a fused qkv output is laid out: per head (GPT-NeoX) or as q|k|v blocks (the rest)."""
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    return "per_head" if model_type in ("gpt_neox", "gpt_neox_japanese", "bloom") else "blocks"


def _group_segments(group: _Group, shapes: Mapping[str, tuple[int, int]], heads: Heads | None, tp: int,
                    rank: int, layout: str) -> dict[str, Segments] | None:
    """This rank's segments for the consumer and each producer, or None when the shapes fit no split."""
    width = shapes[group.consumer][1]
    out: dict[str, Segments] = {}
    if heads is not None and width == heads.heads * heads.head_dim and heads.heads >= 1:
        q_heads, kv_heads = head_plan(heads.heads, heads.kv_heads, tp)[rank]
        hd, nq, nkv = heads.head_dim, heads.heads * heads.head_dim, heads.kv_heads * heads.head_dim
        q, kv = _segments(q_heads, hd), _segments(kv_heads, hd)
        by_width = {nq: q, nkv: kv}
        if layout == "per_head" and heads.kv_heads == heads.heads:
            by_width[3 * nq] = _segments(q_heads, 3 * hd)
        else:
            by_width[nq + 2 * nkv] = q + _segments(kv_heads, hd, nq) + _segments(kv_heads, hd, nq + nkv)
    else:
        mine = _even(width, tp)[rank]
        own = ((mine.start, mine.stop),)
        by_width = {width: own, 2 * width: own + ((width + mine.start, width + mine.stop),)}
    out[group.consumer] = by_width[width] if width in by_width else None
    for p in group.producers:
        out[p] = by_width.get(shapes[p][0])
    return None if any(v is None for v in out.values()) else out


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common[:-1] if len(common) == min(len(p) for p in parts) else common)


# Attribute names that hold a head count or a width of all heads (others, e.g. head_dim,
# rotary_ndims or layer_idx, may hold the same number by coincidence and must stay).
_HEAD_ATTRS = ("heads", "split_size", "embed_dim", "all_head_size", "inner_dim", "kv_dim", "q_dim")


def local_attributes(model: nn.Module, scope: str, heads: Heads, q_heads: int, kv_heads: int
                      ) -> list[tuple[str, str, int]]:
    """The int attributes under ``scope`` holding a global head count or width, with local values."""
    hd = heads.head_dim
    local = {heads.heads: q_heads, heads.heads * hd: q_heads * hd}
    local.setdefault(heads.kv_heads, kv_heads)
    local.setdefault(heads.kv_heads * hd, kv_heads * hd)
    found = []
    root = model.get_submodule(scope) if scope else model
    for sub_name, module in root.named_modules():
        if is_linear(module):
            continue
        for attr, value in vars(module).items():
            where = ".".join(p for p in (scope, sub_name) if p)
            if type(value) is int and value in local and any(attr.endswith(k) for k in _HEAD_ATTRS):
                found.append((where, attr, local[value]))
            elif attr.endswith("key_value_groups") and value == heads.heads // heads.kv_heads:
                found.append((where, attr, q_heads // kv_heads))  # KV heads repeated over ranks: fewer per group
    return found


def example_input(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """A 4-token ``input_ids`` batch, the smallest input a Hugging Face model runs on."""
    return {"input_ids": torch.ones(1, 4, dtype=torch.long, device=device)}


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _uses(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter's owners (module names): tied weights have several."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name.rpartition(".")[0])
    return owners


def _vocab_split(vocab: int, tp: int, rank: int) -> tuple[Segments, tuple[int, ...]]:
    parts = _even(vocab, tp)
    return ((parts[rank].start, parts[rank].stop),), tuple(len(p) for p in parts)


def _embedding_shards(model: nn.Module, vocab: int | None, tp: int, rank: int) -> list[ShardSpec]:
    """Embeddings as tall as the vocabulary, split over their rows. Only ``nn.Embedding``'s own
    forward is known to be a plain lookup (a subclass may scale or normalize: it stays whole)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward \
                and module.num_embeddings == vocab and module.max_norm is None:
            out.append(ShardSpec(name, "embedding", *_vocab_split(vocab, tp, rank)))
    return out


def _vocab_shards(model: nn.Module, producers_of: Mapping[str, frozenset[str]], sharded: set[str],
                  shapes: Mapping[str, tuple[int, int]], vocab: int | None, tp: int, rank: int) -> list[ShardSpec]:
    """The output layer (a traced producer as wide as the vocabulary, feeding no row layer): split
    over the vocabulary and gathered. A weight tied to an embedding is split only when that
    embedding is (the two then share one shard; a second, whole copy would cost memory instead)."""
    owners = _uses(model)
    out = []
    for name, fed_by in producers_of.items():
        module = model.get_submodule(name)
        if fed_by or name in sharded or shapes[name][0] != vocab:
            continue
        if any(owner != name and owner not in sharded for owner in owners.get(id(module.weight), [])):
            continue
        out.append(ShardSpec(name, "vocab", *_vocab_split(vocab, tp, rank)))
    return out


def plan_tensor_parallel(model: nn.Module, tp: int, rank: int, policy: Mapping[Any, Any] | None = None) -> TPPlan:
    """The sharding of ``model`` on ``rank`` of ``tp`` (see the module docstring).

    Raises:
        UsageError: the model cannot be traced and has no ``injection_policy``, or a head split
            that cannot be made.
    """
    shapes = {n: linear_shape(m) for n, m in model.named_modules() if is_linear(m)}
    try:
        producers_of = trace_producers(model, example_input(model, _device(model)))
    except Exception as err:  # the model's own code: any failure means "no dataflow", said once
        if policy is None:
            raise UsageError(f"AutoTP could not run {type(model).__name__} on an input_ids batch to find its "
                             f"layers ({type(err).__name__}: {str(err)[:200]}); pass injection_policy="
                             "{BlockClass: ('row_linear_name', ...)}") from None
        producers_of = {}
    groups = _policy_groups(model, policy, producers_of) if policy else _groups(producers_of)
    heads, layout = config_heads(model), _fused_layout(model)
    shards: list[ShardSpec] = []
    attributes: list[tuple[str, str, int]] = []
    for group in groups:
        segs = _group_segments(group, shapes, heads, tp, rank, layout)
        if segs is None:
            continue  # shapes that fit no split: the group stays replicated (listed in the log line)
        shards.append(ShardSpec(group.consumer, "row", segs[group.consumer]))
        shards.extend(ShardSpec(p, "column", segs[p]) for p in group.producers)
        width = shapes[group.consumer][1]
        if heads is not None and width == heads.heads * heads.head_dim:
            q_heads, kv_heads = head_plan(heads.heads, heads.kv_heads, tp)[rank]
            scope = _common_prefix([group.consumer, *group.producers])
            attributes += local_attributes(model, scope, heads, len(q_heads), len(kv_heads))
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    shards += _embedding_shards(model, vocab, tp, rank)  # before the output layer: a tied one reuses the shard
    shards += _vocab_shards(model, producers_of, {s.name for s in shards}, shapes, vocab, tp, rank)
    sharded = {s.name for s in shards}
    return TPPlan(tuple(shards), tuple(dict.fromkeys(attributes)), tuple(n for n in shapes if n not in sharded))


def iter_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((n, m) for n, m in model.named_modules() if is_linear(m))
