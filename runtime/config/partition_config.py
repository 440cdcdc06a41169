"""``tensor_parallel.partition_config``: DeepSpeed's hand-written AutoTP layer rules (0.18+).

``{"use_default_specs": false, "layer_specs": [{"patterns": [".*\\\\.o_proj\\\\.weight$"],
"partition_type": "row"}, {"patterns": [".*\\\\.[qkv]_proj\\\\.weight$"], "partition_type": "column"}]}``

Each Linear's ``<qualified name>.weight`` is matched (``re.match``) against the specs' patterns in
order, the first match wins: ``column`` keeps this rank's output features (``gather_output``: its
slices are gathered, every rank gets the whole output), ``row`` this rank's input features (one
all-reduce after it), ``skip`` and no match leave the Linear whole (``strict_mode``: no match is an
error). ``shape`` cuts a fused weight into sub-parameters along the split dimension (``[3, -1]``:
three equal ones, ``[[q, k, v], -1]``: of those sizes), each split over the ranks.
``model_types`` limits a spec to models whose ``config.model_type`` is listed (without one: the family
in the model's class name, ``GPT2Block`` -> ``gpt2``, as DeepSpeed). ``grad_allreduce``
(skip specs): the replicated parameter's gradient is summed over the tensor group.

The rules replace dslaunch's dataflow planner for the model (as DeepSpeed's replace its
heuristics); ``use_default_specs`` only merges with a ``preset_model``, which dslaunch refuses,
so it changes nothing. Torch-free: the rules are checked here, applied by
``runtime/tensor_parallel/partition.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import Option, boolean, check_params, choice, describe, integer

__all__ = ["LayerSpec", "PartitionConfig", "parse_partition_config"]

Shape = tuple[Any, ...]  # ints (-1: inferred), and at the split dimension maybe a tuple of sizes


@dataclass(frozen=True)
class LayerSpec:
    """One rule: the Linears whose weight name matches ``patterns`` and how they are split."""

    patterns: tuple[str, ...]
    partition_type: str = "column"  # "column" | "row" | "skip"
    gather_output: bool = False
    grad_allreduce: bool = False
    shape: Shape | None = None
    partition_dim: int | None = None
    model_types: tuple[str, ...] | None = None

    @property
    def split_dim(self) -> int:
        """The weight dimension split (after ``shape``): DeepSpeed's default, 0 column, 1 row."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == "column" else 1

    def matches(self, param_name: str, model_type: str | None) -> bool:
        if self.model_types is not None and (model_type is None or model_type.lower() not in self.model_types):
            return False
        return any(re.match(p, param_name) for p in self.patterns)


@dataclass(frozen=True)
class PartitionConfig:
    """The checked ``partition_config`` block."""

    layer_specs: tuple[LayerSpec, ...] = ()
    use_default_specs: bool = True
    strict_mode: bool = False
    lm_head_patterns: tuple[str, ...] = ("lm_head", "embed_out")

    def spec_for(self, param_name: str, model_type: str | None) -> LayerSpec | None:
        """The first spec matching ``param_name`` (DeepSpeed warns when several do; the first wins)."""
        return next((s for s in self.layer_specs if s.matches(param_name, model_type)), None)


def _strings(path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"must be a list of strings, got {describe(value)}", key=path)
    return tuple(value)


def _patterns(path: str, value: Any) -> tuple[str, ...]:
    patterns = _strings(path, value)
    if not patterns:
        raise ConfigError("must list at least one regular expression, e.g. [\".*\\\\.o_proj\\\\.weight$\"]", key=path)
    for i, p in enumerate(patterns):
        try:
            re.compile(p)
        except re.error as err:
            raise ConfigError(f"{p!r} is not a regular expression ({err})", key=f"{path}[{i}]") from None
    return patterns


def _shape(path: str, value: Any) -> Shape | None:
    """DeepSpeed's rules: ints > 0 or -1, one level of sizes (> 0) allowed at the split dimension
    (checked against it by ``_spec``)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ConfigError(f"must be a list such as [3, -1] or [[4096, 1024, 1024], -1], got {describe(value)}",
                          key=path)
    out: list[Any] = []
    for i, dim in enumerate(value):
        if isinstance(dim, list):
            if not dim or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in dim):
                raise ConfigError(f"sub-parameter sizes must be integers > 0, got {describe(dim)}", key=f"{path}[{i}]")
            out.append(tuple(dim))
        elif isinstance(dim, int) and not isinstance(dim, bool) and (dim > 0 or dim == -1):
            out.append(dim)
        else:
            raise ConfigError(f"must be an integer > 0, -1 (inferred) or a list of sizes, got {describe(dim)}",
                              key=f"{path}[{i}]")
    return tuple(out)


def _optional(check: Any) -> Any:
    return lambda path, value: None if value is None else check(path, value)


_SPEC = {"patterns": Option(None, _patterns), "partition_type": Option("column", choice("column", "row", "skip")),
         "gather_output": Option(False, boolean), "grad_allreduce": Option(False, boolean),
         "shape": Option(None, _shape), "partition_dim": Option(None, _optional(integer(0))),
         "model_types": Option(None, _optional(_strings))}


def _spec(path: str, value: Any) -> LayerSpec:
    raw = dict(value) if isinstance(value, Mapping) else value
    if isinstance(raw, dict) and isinstance(raw.get("partition_type"), str):
        raw["partition_type"] = raw["partition_type"].lower()  # DeepSpeed reads it case-blind
    fields = check_params(raw, _SPEC, path, "an AutoTP layer spec")
    if fields["patterns"] is None:
        raise ConfigError("is required: the regular expressions of the weight names it applies to",
                          key=f"{path}.patterns")
    if fields["model_types"] is not None:
        fields["model_types"] = tuple(t.lower() for t in fields["model_types"])
    spec = LayerSpec(**fields)
    if spec.gather_output and spec.partition_type != "column":
        raise ConfigError("applies to column specs only (a row layer's output is whole already)",
                          key=f"{path}.gather_output")
    if spec.grad_allreduce and spec.partition_type != "skip":
        raise ConfigError("applies to skip specs only (a split parameter's gradient is already its slice's)",
                          key=f"{path}.grad_allreduce")
    if spec.shape is not None:
        dim = spec.split_dim
        if dim >= len(spec.shape):
            raise ConfigError(f"{dim} is out of range for shape {list(spec.shape)}", key=f"{path}.partition_dim")
        nested = [i for i, d in enumerate(spec.shape) if isinstance(d, tuple)]
        if nested and nested != [dim]:
            raise ConfigError(f"sub-parameter sizes are allowed at the split dimension ({dim}) only",
                              key=f"{path}.shape")
    return spec


def _specs(path: str, value: Any) -> tuple[LayerSpec, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"must be a list of layer specs, got {describe(value)}", key=path)
    return tuple(_spec(f"{path}[{i}]", v) for i, v in enumerate(value))


_BLOCK = {"layer_specs": Option((), _specs), "use_default_specs": Option(True, boolean),
          "strict_mode": Option(False, boolean), "lm_head_patterns": Option(("lm_head", "embed_out"), _strings),
          "embedding_partition_dim": Option(1, integer(0, 1)), "tp_size": Option(None, _optional(integer(1)))}


def parse_partition_config(path: str, value: Any) -> PartitionConfig | None:
    """The checked block (None for null).

    Raises:
        ConfigError: an unknown key, a bad pattern, type or shape (one line naming the key).
    """
    if value is None:
        return None
    fields = check_params(value, _BLOCK, path, "tensor_parallel.partition_config")
    # tp_size is autotp_size's (DeepSpeed overwrites it); embedding_partition_dim only splits
    # embeddings, which partition_config does not do in dslaunch (partition.py refuses them).
    fields.pop("tp_size")
    fields.pop("embedding_partition_dim")
    return PartitionConfig(**fields)
