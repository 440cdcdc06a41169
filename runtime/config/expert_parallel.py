"""The ds_config ``expert_parallel`` block: AutoEP (DeepSpeed 0.19.2+).

``{"expert_parallel": {"enabled": true, "autoep_size": 2, "preset_model": "mixtral"}}``

When enabled, ``initialize`` converts the Hugging Face MoE blocks of the model into expert-parallel
form (``runtime/moe/autoep.py``): each of the ``autoep_size`` ranks of an expert group keeps
``num_experts / autoep_size`` experts and tokens travel to them by all-to-all.

Every key of DeepSpeed's ``AutoEPConfig`` is known. The layer-finding keys (``moe_layer_pattern``,
``router_pattern``, ``expert_pattern``, ``expert_w1/w2/w3``, ``num_experts_attr``, ``top_k_attr``,
the shared-expert keys) override the preset's. The routing keys (``top_k``, ``route_norm``,
``score_func``, ``route_scale``, ``routed_scaling_factor``, the expert groups) are checked at
conversion against what the model's own router does: dslaunch routes with the model's router, so
a value that differs is refused there. ``use_grouped_mm``: ``torch._grouped_mm`` where the device
and shapes allow it, else a loop. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, choice, describe, integer, number
from dslaunch.runtime.config.sections import _opt, optional, parse_section

__all__ = ["ExpertParallelConfig", "PRESET_NAMES", "parse_autoep_config"]

PRESET_NAMES = ("mixtral", "qwen3_moe", "deepseek_v3")


def _name(path: str, value: Any) -> str:
    """A direct attribute name (no dots), as DeepSpeed's patterns of children are."""
    if not isinstance(value, str) or not value or "." in value:
        raise ConfigError(f"must be an attribute name without dots (e.g. \"gate\"), got {describe(value)}", key=path)
    return value


def _pattern(path: str, value: Any) -> str:
    import re

    if not isinstance(value, str) or not value:
        raise ConfigError(f"must be a regular expression over module names, got {describe(value)}", key=path)
    try:
        re.compile(value)
    except re.error as err:
        raise ConfigError(f"is not a valid regular expression ({err})", key=path) from None
    return value


def _auto_or(check: Any) -> Any:
    return lambda path, value: "auto" if value == "auto" else check(path, value)


def _null_only(path: str, value: Any) -> None:
    if value is not None:
        raise ConfigError(f"{describe(value)} is not supported: auxiliary-loss-free balancing (an expert_bias per "
                          "expert) is not implemented, as in DeepSpeed; set it to null or omit the key", key=path)


def _expert_tp(path: str, value: Any) -> int:
    if integer(1)(path, value) != 1:
        raise ConfigError(f"{value} is refused: expert tensor parallelism is not implemented (DeepSpeed accepts only "
                          "1 too); remove the key", key=path)
    return 1


def _post_only(path: str, value: Any) -> str:
    if choice("auto", "pre", "post")(path, value) == "pre":
        raise ConfigError("\"pre\" is not implemented by dslaunch: the routing weights scale the experts' outputs "
                          "(\"post\", as the Hugging Face models do); remove the key", key=path)
    return value


@dataclass(frozen=True)
class ExpertParallelConfig:
    """``expert_parallel``: AutoEP's switch, degree and how to find the MoE blocks."""

    enabled: bool = _opt(False, boolean, "true or false")
    autoep_size: int = _opt(1, integer(1), "ranks that share one layer's experts, e.g. 2 (it must divide the "
                            "world and every MoE layer's expert count)")
    """Expert-parallel degree: the experts of a layer are spread over this many ranks; the world's
    other ranks are expert-data peers that hold the same experts. 1 keeps every expert local."""
    preset_model: str | None = _opt(None, optional(choice(*PRESET_NAMES)), ", ".join(PRESET_NAMES))
    """The model family (None: from ``model.config.model_type``, else every preset is tried)."""
    use_grouped_mm: bool = _opt(True, boolean, "true or false")
    """The local experts' matmuls as one ``torch._grouped_mm`` each (a loop over experts where it
    is missing or the shapes do not fit its 16-byte alignment; a log line says so)."""
    expert_tensor_parallel_size: int = _opt(1, _expert_tp, "1")
    moe_layer_pattern: str | None = _opt(None, optional(_pattern), "a regular expression over module names, "
                                         "e.g. \"model\\\\.layers\\\\.\\\\d+\\\\.mlp\"")
    router_pattern: str | None = _opt(None, optional(_name), "the router's attribute name, e.g. \"gate\"")
    expert_pattern: str | None = _opt(None, optional(_name), "the experts' attribute name, e.g. \"experts\"")
    expert_w1: str | None = _opt(None, optional(_name), "the gate (or fused gate+up) weight's name")
    expert_w2: str | None = _opt(None, optional(_name), "the down projection weight's name")
    expert_w3: str | None = _opt(None, optional(_name), "the up projection weight's name (null: fused in w1)")
    num_experts_attr: str | None = _opt(None, optional(_name), "the model.config attribute of the expert count")
    top_k_attr: str | None = _opt(None, optional(_name), "the model.config attribute of experts per token")
    has_shared_experts: bool | None = _opt(None, optional(boolean), "true or false")
    shared_experts_pattern: str | None = _opt(None, optional(_name), "the shared experts' attribute name")
    shared_experts_gate_pattern: str | None = _opt(None, optional(_name), "the shared experts' gate's attribute name")
    top_k: int | str = _opt("auto", _auto_or(integer(1)), "\"auto\" (the model's) or an integer")
    route_norm: bool | None = _opt(None, optional(boolean), "null (the model's), true or false")
    score_func: str = _opt("auto", choice("auto", "softmax", "sigmoid"), "auto, softmax or sigmoid")
    route_scale: float = _opt(1.0, number(0.0, low_open=True), "a number > 0")
    routed_scaling_factor: float | str = _opt("auto", _auto_or(number(0.0, low_open=True)), "\"auto\" or a number")
    num_expert_groups: int | None = _opt(None, optional(integer(1)), "null or an integer")
    num_limited_groups: int | None = _opt(None, optional(integer(1)), "null or an integer")

    AUTO_OK = ("top_k", "routed_scaling_factor", "score_func", "score_apply", "combine_impl")  # "auto": the default
    # checked, then dropped: they only choose between implementations of the same arithmetic
    INERT = {"score_apply": _post_only, "combine_impl": choice("auto", "weighted_sum", "legacy_bmm"),  # noqa: RUF012
             "disable_triton_grouped_mm": boolean, "validate_folding_routing": boolean,
             "load_balance_coeff": _null_only}
    UNIMPLEMENTED = {}  # noqa: RUF012

    @property
    def size(self) -> int:
        """The expert-parallel degree (1 when off)."""
        return self.autoep_size if self.enabled else 1

    def check(self, cfg: Any) -> None:
        """AutoEP folded with AutoTP (``tensor_parallel.autotp_size`` > 1: ``runtime/moe/autoep_folded.py``)
        against the rest of the config ``cfg`` (a ``DeepSpeedConfig``), before any group exists; the
        sizes against the world are checked when the groups are made (``moe/folding.py``).

        Raises:
            ConfigError: one line naming the key: ``autoep_size`` 1 beside AutoTP (each slice would
                run every route), ``use_data_before_expert_parallelism``, sequence parallelism or ZeRO
                offload beside a folded run (DeepSpeed's rules).
        """
        tensor = cfg.tensor_parallel.size
        if not self.enabled or tensor <= 1:
            return
        zero = cfg.zero_optimization
        refusals = [
            (self.autoep_size == 1, "expert_parallel.autoep_size",
             f"1 beside tensor_parallel.autotp_size={tensor}: AutoEP folded with AutoTP needs autoep_size > 1 "
             "(with every expert local each tensor slice would run every route); set it to a divisor of the "
             "expert count > 1, or remove tensor_parallel"),
            (cfg.use_data_before_expert_parallelism, "use_data_before_expert_parallelism",
             "true cannot be combined with AutoEP folded with AutoTP (its expert groups are neighbouring ranks); "
             "set it to false"),
            (cfg.sequence_parallel_size > 1, "sequence_parallel_size",
             f"{cfg.sequence_parallel_size} and tensor_parallel.autotp_size={tensor} are mutually exclusive "
             "with AutoEP; use one of them"),
            (zero.offload_optimizer.enabled or zero.offload_param.enabled, "zero_optimization.offload_optimizer",
             "ZeRO offload with AutoEP folded with AutoTP is not supported (as in DeepSpeed); turn offload off"),
        ]
        for broken, key, message in refusals:
            if broken:
                raise ConfigError(message, key=key)


def parse_autoep_config(param_dict: Any) -> ExpertParallelConfig:
    """DeepSpeed's ``parse_autoep_config``: the ``expert_parallel`` section (a dict or None) parsed.

    Raises:
        ConfigError: as ``load_config`` for the block (unknown key, bad value).
    """
    return parse_section(ExpertParallelConfig, param_dict, "expert_parallel")
