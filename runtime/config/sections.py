"""The ds_config sections as typed, frozen dataclasses, and the one way a section is parsed.

Each field carries its checker and a short help text in its metadata; ``parse_section`` turns a
user dict into the dataclass: unknown keys -> ``ConfigError`` with did-you-mean, wrong types and
ranges name the key path (checkers from ``param_schema``), ``"auto"`` explains what to put there.

Keys DeepSpeed accepts that dslaunch does not implement are never silently ignored: each has an
``Off`` description of when it is switched off (its documented off/default values, or an
``enabled``-like switch set to off), and anything else is reported as "not implemented yet"
naming the first key path that is on (``reject_unimplemented``). Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean
from dslaunch.runtime.config.param_schema import (
    Option,
    boolean,
    check_params,
    choice,
    describe,
    integer,
    number,
)
from dslaunch.runtime.zero.registry import stage_choices

__all__ = ["parse_section", "legacy_zero_forms", "offload_optimizer_section", "offload_param_section", "ZeroConfig", "OffloadConfig", "Fp16Config", "Bf16Config", "CheckpointConfig",
           "TypedSection", "OptimizerSection", "optional", "Off", "ANY", "UNIMPLEMENTED_KEYS",
           "reject_unimplemented"]


def optional(check: Any) -> Any:
    """A checker that also accepts null (None)."""
    return lambda path, value: None if value is None else check(path, value)


def _tag_validation(path: str, value: Any) -> str:
    # DeepSpeed compares case-insensitively; keep its capitalised spelling.
    valid = ("Ignore", "Warn", "Fail")
    if isinstance(value, str) and value.capitalize() in valid:
        return value.capitalize()
    return choice(*valid)(path, value)


def _opt(default: Any, check: Any, help: str) -> Any:
    return field(default=default, metadata={"check": check, "help": help})


def _only(honoured: bool, instead: str) -> Any:
    """A boolean dslaunch honours with one value only; the other says what dslaunch does instead."""

    def check(path: str, value: Any) -> bool:
        if boolean(path, value) != honoured:
            raise ConfigError(f"{_json(value)} is not implemented by dslaunch yet: {instead}; remove the "
                              f"key or set it to {_json(honoured)}", key=path)
        return honoured

    return check


# ---- keys DeepSpeed has and dslaunch does not implement -------------------------------------------
@dataclass(frozen=True)
class Off:
    """When an unimplemented DeepSpeed feature (a section of keys) counts as switched off.

    ``values`` maps each known key to its off value: a value, a tuple of accepted values, a
    nested ``Off``, or ``ANY``. ``switch`` names a key (e.g. ``enabled``) whose off value turns
    the whole feature off, whatever else the section holds. Without the switch every key given
    must be known and hold its off value: a dict is not "off" just because it has no flag.
    """

    values: Mapping[str, Any] = field(default_factory=dict)
    switch: str | None = None


# Any value: the key only tunes a feature that is itself rejected unless off (e.g. NVMe offload).
ANY: Any = object()
_REMOVE: Any = object()  # marks "no off value to suggest: remove the key"
_UNLISTED: Any = object()  # marks a key this module does not know in that section


def _json(value: Any) -> str:
    return json.dumps(value)


def _same(value: Any, off: Any) -> bool:
    # True == 1 in Python; a boolean switch must not be satisfied by 1 or 0.
    return isinstance(value, bool) == isinstance(off, bool) and value == off


def _first_on(value: Any, spec: Any, path: str) -> tuple[str, Any, str] | None:
    """``(key path, its off value, hint)`` of the first part of ``value`` that is on; None if off."""
    if value is None or spec is ANY:  # null is how DeepSpeed spells "not configured"
        return None
    if not isinstance(spec, Off):
        offs = spec if isinstance(spec, tuple) else (spec,)
        return None if any(_same(value, o) for o in offs) else (path, offs[0], "")
    if not isinstance(value, Mapping):
        return path, _REMOVE, ""
    if spec.switch is not None and spec.switch in value:
        return _first_on(value[spec.switch], spec.values[spec.switch], f"{path}.{spec.switch}")
    for key, sub in value.items():
        if key not in spec.values:
            return f"{path}.{key}", _UNLISTED, did_you_mean(str(key), spec.values)
        found = _first_on(sub, spec.values[key], f"{path}.{key}")
        if found is not None:
            return found
    return None


def reject_unimplemented(key: str, value: Any, spec: Any) -> None:
    """Raise unless ``value`` leaves the unimplemented DeepSpeed feature ``key`` switched off.

    Raises:
        ConfigError: naming the first key path that is on and how to switch it off.
    """
    found = _first_on(value, spec, key)
    if found is None:
        return
    path, off, hint = found
    what = "is accepted by DeepSpeed but not implemented by dslaunch yet"
    if off is _UNLISTED:
        parent = path.rpartition(".")[0]
        what = f"is not a known key of '{parent}'{hint}, which dslaunch does not implement yet"
    if off is _REMOVE or off is _UNLISTED:
        fix = "remove it" if path == key else f"remove it (or remove '{key}')"
    elif path == key:
        fix = f"remove it (or set it to {_json(off)})"
    else:
        fix = f"set it to {_json(off)} (or remove '{key}')"
    raise ConfigError(f"{what}; {fix}", key=path)


def _enabled() -> Off:
    """A feature switched by ``enabled`` (off: false); its other keys only matter when it is on."""
    return Off({"enabled": False}, switch="enabled")


# ---- the sections -------------------------------------------------------------------------------
def _offload_device(path: str, value: Any) -> str:
    if value in (None, "none"):
        return "none"
    return choice("none", "cpu", "nvme")(path, value)


def _text(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"must be a non-empty string (a directory), got {describe(value)}", key=path)
    return value


@dataclass(frozen=True)
class OffloadConfig:
    """``zero_optimization.offload_optimizer`` / ``offload_param``: host memory or NVMe files
    between uses (``runtime/zero/offload/``)."""

    device: str = _opt("none", _offload_device, "\"cpu\", \"nvme\" or \"none\"")
    pin_memory: bool = _opt(True, boolean, "true to page-lock the host copies (GPU hosts)")
    # offload_optimizer at stage 3 only: the fraction of each shard's master and state in host memory.
    ratio: float = _opt(1.0, number(0.0, 1.0), "a fraction, e.g. 0.5 (1.0: the whole optimizer state)")
    nvme_path: str | None = _opt(None, optional(_text), "a directory on the NVMe disk, e.g. \"/local_nvme\"")
    buffer_count: int = _opt(4, integer(1), "swap buffers, e.g. 4 (an Adam bucket takes 2)")
    buffer_size: int = _opt(100_000_000, integer(1), "elements per swap buffer, e.g. 1e8")
    pipeline_read: bool = _opt(False, boolean, "true to read the next bucket while one is updated")
    pipeline_write: bool = _opt(False, boolean, "true to write a bucket back while the next is updated")
    # offload_param with nvme only: this rank's first max_in_cpu shard elements stay in host memory.
    max_in_cpu: int = _opt(1_000_000_000, integer(0), "elements kept in host memory, e.g. 1e9 (0: all on NVMe)")

    # They tune DeepSpeed's swapper or its CPU Adam: any value changes nothing.
    UNIMPLEMENTED = {k: ANY for k in ("pipeline", "fast_init",  # noqa: RUF012
                                      "super_offload", "cpuadam_cores_perc")}

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's summary of the two: any overlap of swaps with the update."""
        return self.pipeline_read or self.pipeline_write


@dataclass(frozen=True)
class AioConfig:
    """``aio``: how NVMe swap files are read and written (a thread pool of ``os.preadv``/``pwritev``;
    no native aio extension)."""

    block_size: int = _opt(1_048_576, integer(512), "bytes per read/write request, e.g. 1048576")
    queue_depth: int = _opt(8, integer(1, 1024), "requests in flight (I/O threads), e.g. 8")
    # DeepSpeed's libaio knobs: checked, then meaningless for a thread pool.
    INERT = {"thread_count": integer(1), "single_submit": boolean,  # noqa: RUF012
             "overlap_events": boolean, "intra_op_parallelism": integer(1)}
    UNIMPLEMENTED = {"use_gds": False}  # noqa: RUF012


def _offload_section(foreign: Mapping[str, str], **defaults: Any) -> Callable[[str, Any], OffloadConfig]:
    """The checker of one offload section: ``OffloadConfig``, less the keys of the other section
    (``foreign``: key -> why), refused rather than read by no one; ``defaults`` where this section's
    differ from ``OffloadConfig``'s."""

    def check(path: str, value: Any) -> OffloadConfig:
        for key in foreign.keys() & (value.keys() if isinstance(value, Mapping) else set()):
            raise ConfigError(f"is not read in this section: {foreign[key]}; remove it", key=f"{path}.{key}")
        given = {**defaults, **value} if isinstance(value, Mapping) else value
        return parse_section(OffloadConfig, given, path)

    return check


offload_optimizer_section = _offload_optimizer = _offload_section({
    "max_in_cpu": "it is an offload_param key (parameter elements kept in host memory with nvme); "
                  "the share of the optimizer state in host memory is offload_optimizer.ratio (stage 3)"})
offload_param_section = _offload_param = _offload_section({
    "ratio": "it is an offload_optimizer key (stage 3); offloaded parameters are all off the device, "
             "and with nvme offload_param.max_in_cpu keeps some in host memory"},
    buffer_count=5)  # DeepSpeed's parameter swapper defaults to 5 buffers, its optimizer swapper to 4


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: which ZeRO stage and its communication knobs."""

    stage: int = _opt(0, integer(0, 3), f"the ZeRO stage: {stage_choices()}")
    reduce_bucket_size: int = _opt(500_000_000, integer(1), "elements reduced per bucket, e.g. 5e8")
    allgather_bucket_size: int = _opt(500_000_000, integer(1), "elements gathered per bucket, e.g. 5e8")
    overlap_comm: bool = _opt(None, optional(boolean), "true to overlap gradient reduction with backward")
    """Default (null): true at stage 3, false below it, as DeepSpeed's."""
    overlap_param_gather: bool = _opt(False, boolean, "true to keep stage 1/2's publish of updated weights "
                                      "in flight into the next forward")
    """dslaunch's key (Megatron's name; DeepSpeed has none): at stages 1 and 2 the broadcasts of the
    updated shards stay in flight after ``step()`` and each module's forward waits only for its own
    weights. Off by default because a script that reads weights between ``step()`` and the next
    forward (an EMA, a weight-norm log through ``parameters()``) would read a mix of old and new
    values; the engine's own readers (save, ``state_dict``, eval) wait first."""
    contiguous_gradients: bool = _opt(True, _only(True, "dslaunch always copies gradients into contiguous "
                                                  "buffers (one flat buffer per param group at stages 0-1, "
                                                  "the reduce buckets at stage 2)"), "true")
    reduce_scatter: bool = _opt(True, boolean, "true or false (no effect: always all-reduce)")
    """Performance knob, no effect on results: dslaunch always averages gradients with a bucketed
    all-reduce (on gloo faster than reduce-scatter), so either value gives the same gradients."""
    allgather_partitions: bool = _opt(True, boolean, "true or false (no effect: always broadcasts)")
    """Performance knob, no effect on results: dslaunch always publishes updated shards with
    chunked broadcasts (what DeepSpeed does with false); the gathered weights are identical."""
    use_multi_rank_bucket_allreduce: bool = _opt(True, boolean, "true or false (no effect)")
    """Performance knob for DeepSpeed's reduce path (reduce_scatter false); dslaunch always
    all-reduces whole buckets, so neither value changes anything."""
    round_robin_gradients: bool = _opt(False, boolean, "true or false (no effect without offload)")
    """DeepSpeed's CPU-offload optimization (which rank copies which gradients to the host);
    dslaunch has no offload (``offload_optimizer`` is rejected), so it changes nothing."""
    elastic_checkpoint: bool = _opt(False, boolean, "true or false (no effect)")
    """DeepSpeed's choice of on-disk layout for stage 1/2 optimizer state; dslaunch has one layout,
    which loads at any world size and ZeRO stage 0-3 with either value. True at stage 3 warns, as
    DeepSpeed (which deprecated it there) does."""
    ignore_unused_parameters: bool = _opt(True, _only(True, "a parameter that gets no gradient "
                                                      "is always treated as a zero gradient"), "true")
    load_from_fp32_weights: bool = _opt(True, _only(True, "the fp32 master weights are always restored "
                                                    "from the checkpoint's fp32 copy (no 16-bit copy of "
                                                    "trained parameters is stored)"), "true")

    # Stage 3 (read only there; see runtime/zero/stage3.py). DeepSpeed also accepts each without
    # the ``stage3_`` prefix (``STAGE3_ALIASES``); "auto" keeps the default.
    stage3_param_persistence_threshold: int = _opt(100_000, integer(0), "elements, e.g. 1e5: smaller "
                                                   "parameters stay whole on every rank")
    stage3_prefetch_bucket_size: int = _opt(50_000_000, integer(0), "elements, e.g. 5e7: parameters of the "
                                            "next modules gathered ahead of use (0: none)")
    stage3_max_live_parameters: int = _opt(1_000_000_000, integer(0), "elements, e.g. 1e9: whole "
                                           "parameters kept at once (least recently used released first)")
    stage3_max_reuse_distance: int = _opt(1_000_000_000, integer(0), "elements, e.g. 1e9: a parameter used "
                                          "again within this many is kept whole (0: always released)")
    stage3_gather_16bit_weights_on_model_save: bool = _opt(False, boolean, "true to gather the whole "
                                                           "16-bit model for save_16bit_model()")
    # ZeRO++ (stage 3; see runtime/zero/zeropp.py)
    zero_quantized_weights: bool = _opt(False, boolean, "true to gather parameters as block-quantized int8 "
                                        "(stage 3)")
    zero_quantized_gradients: bool = _opt(False, boolean, "true to reduce gradients as block-quantized int4 "
                                          "in two hops, within each node then across (stage 3)")
    zero_hpz_partition_size: int = _opt(1, integer(1), "ranks per secondary parameter shard: 1 (off) or the "
                                        "ranks per node (or a divisor of it), e.g. 2 (stage 3)")
    sub_group_size: int = _opt(1_000_000_000, integer(1), "elements per offloaded optimizer bucket, e.g. 1e9")
    """Offload only: the master shard is updated in buckets of this many elements (DeepSpeed's
    optimizer sub-groups), so transfers of one bucket overlap the update of another."""

    STAGE3_ALIASES = {"param_persistence_threshold": "stage3_param_persistence_threshold",
                      "prefetch_bucket_size": "stage3_prefetch_bucket_size",
                      "max_live_parameters": "stage3_max_live_parameters",
                      "max_reuse_distance": "stage3_max_reuse_distance",
                      "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
                      "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
                      # keys dslaunch does not read (STAGE3_ONLY), under DeepSpeed's other spelling
                      "stage3_model_persistence_threshold": "model_persistence_threshold",
                      "stage3_module_granularity_threshold": "module_granularity_threshold",
                      "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
                      "stage3_allgather_sequential": "allgather_sequential"}

    offload_optimizer: OffloadConfig = _opt(OffloadConfig(), _offload_optimizer, "an object such as "
                                            "{\"device\": \"cpu\"} (stages 1-3)")
    offload_param: OffloadConfig = _opt(OffloadConfig(buffer_count=5), _offload_param, "an object such as "
                                        "{\"device\": \"cpu\"} (stage 3)")

    # DeepSpeed keys not implemented here -> when they are off.
    def __post_init__(self) -> None:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        from dslaunch.utils.logging import logger

        if self.offload_param.enabled and self.stage != 3:
            # DeepSpeed ignores it silently; refusing would stop a config DeepSpeed runs.
            logger.warning(f"zero_optimization.offload_param: has no effect at ZeRO stage {self.stage} (every rank "
                           "holds all parameters below stage 3), as in DeepSpeed; remove it or use stage 3")
            object.__setattr__(self, "offload_param", OffloadConfig(buffer_count=5))
        if self.elastic_checkpoint and self.stage == 3:
            logger.warning("zero_optimization.elastic_checkpoint: ZeRO-3 elastic checkpointing is deprecated "
                           "(DeepSpeed) and has no effect: dslaunch's stage-3 checkpoints load at any world "
                           "size and ZeRO stage; remove the key")

    # DeepSpeed's attribute names for the stage-3 settings (its config object has no prefix)
    @property
    def param_persistence_threshold(self) -> int:
        return self.stage3_param_persistence_threshold

    @property
    def prefetch_bucket_size(self) -> int:
        return self.stage3_prefetch_bucket_size

    @property
    def max_live_parameters(self) -> int:
        return self.stage3_max_live_parameters

    @property
    def max_reuse_distance(self) -> int:
        return self.stage3_max_reuse_distance

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        return self.stage3_gather_16bit_weights_on_model_save

    @property
    def pipeline_loading_checkpoint(self) -> bool:
        """Always False: dslaunch loads pipeline checkpoints one way (the key is accepted, unread)."""
        return False

    UNIMPLEMENTED = {"zenflow": None,
                     "zero_quantized_nontrainable_weights": False,
                     "mics_shard_size": -1, "mics_hierarchical_params_gather": False,
                     "legacy_stage1": False, "enable_sanity_checks": False}
    # Keys that only configure stage 3 (after STAGE3_ALIASES) and dslaunch does not read (the
    # fields above excepted): any value accepted, "auto" included (the Hugging Face Trainer writes
    # it there). Whole names, not prefixes: a misspelt one must get "did you mean".
    STAGE3_ONLY = frozenset((
        "sub_group_size", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "model_persistence_threshold", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
        "allgather_sequential", "partition_stream_chunk_size", "zeropp_loco_param", "log_trace_cache_warnings",
        "pipeline_loading_checkpoint", "override_module_apply", "memory_efficient_linear", "leaf_module",
        "save_muon_momentum_buffer_in_memory"))


_LEGACY_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def legacy_zero_forms(section: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's deprecated offload switches in today's form (a copy): ``"cpu_offload": true`` is
    ``"offload_optimizer": {"device": "cpu"}``, ``"cpu_offload_param": true`` is ``"offload_param":
    {"device": "cpu"}``, and ``cpu_offload_use_pin_memory`` their ``pin_memory``; false drops them.

    Raises:
        ConfigError: a switch that is not true or false, or given beside the section it stands for.
    """
    raw = dict(section)
    pin = raw.pop("cpu_offload_use_pin_memory", None)
    for old, new in _LEGACY_OFFLOAD.items():
        if old not in raw:
            continue
        on = boolean(f"zero_optimization.{old}", raw.pop(old))
        if on and raw.get(new) is not None:
            raise ConfigError(f"sets the same thing as 'zero_optimization.{new}' (DeepSpeed's older "
                              f"spelling); keep '{new}'", key=f"zero_optimization.{old}")
        if on:
            raw[new] = {"device": "cpu", **({"pin_memory": pin} if pin is not None else {})}
    return raw


# A scale of 2**64 already overflows any fp16 gradient (max 65504); more only skips more steps
# before the dynamic scaler gets down to a usable scale (and 2**128 is inf in fp32).
MAX_SCALE_POWER = 64
MAX_LOSS_SCALE = 2.0**MAX_SCALE_POWER


@dataclass(frozen=True)
class Fp16Config:
    """``fp16``: fp16 model, fp32 master weights, loss scaling (dynamic unless loss_scale > 0)."""

    enabled: bool = _opt(False, boolean, "true or false")
    loss_scale: float = _opt(0.0, number(0.0, MAX_LOSS_SCALE), "0 for dynamic loss scaling, or a fixed scale > 0")
    initial_scale_power: int = _opt(16, integer(0, MAX_SCALE_POWER),
                                    "an integer: the first dynamic scale is 2**power")
    loss_scale_window: int = _opt(1000, integer(1), "steps without overflow before the scale doubles")
    hysteresis: int = _opt(2, integer(1), "overflows tolerated before the scale halves")
    consecutive_hysteresis: bool = _opt(False, boolean, "true or false")
    min_loss_scale: float = _opt(1.0, number(0.0, MAX_LOSS_SCALE, low_open=True),
                                 "the smallest dynamic scale, e.g. 1")

    UNIMPLEMENTED = {"auto_cast": False, "fp16_master_weights_and_grads": False}


@dataclass(frozen=True)
class Bf16Config:
    """``bf16`` (alias ``bfloat16``): bf16 model with fp32 master weights, no loss scaling."""

    enabled: bool = _opt(False, boolean, "true or false")
    check_grad_overflow: bool = _opt(True, boolean, "true to skip a step whose gradients hold inf/NaN")
    """As DeepSpeed's (default true): a step whose global gradient norm is not finite is skipped
    and counted in ``skipped_steps`` (bf16 has no loss scale to lower)."""

    UNIMPLEMENTED = {"immediate_grad_update": False,
                     "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
    # fp16's loss-scaling keys, checked as in fp16 and then ignored: bf16 needs no loss scaling.
    # DeepSpeed's CIFAR example writes them into bf16 (DeepSpeed 0.19.8 itself rejects them there).
    INERT = {f.name: f.metadata["check"] for f in dataclasses.fields(Fp16Config) if f.name != "enabled"}


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: how checkpoints are validated and written (read by the checkpoint code)."""

    tag_validation: str = _opt("Warn", _tag_validation, "Ignore, Warn or Fail")
    async_save: bool = _opt(False, boolean, "true to write checkpoints in the background")
    keep_last: int | None = _opt(None, optional(integer(1)), "how many checkpoints to keep, "
                                 "or null to keep all")
    use_node_local_storage: bool = _opt(False, boolean, "true if each node saves to local disk")
    fsync: bool = _opt(True, boolean, "false to skip fsync as DeepSpeed does: a save then survives a "
                       "killed process but not a power loss")
    format: str = _opt("dslaunch", choice("dslaunch", "deepspeed"), "dslaunch (manifest, any world size on "
                       "load) or deepspeed (the files DeepSpeed 0.19's load_checkpoint reads at the saving "
                       "world size and stage); dslaunch-only")
    load_universal: bool = _opt(False, boolean, "true to load a universal checkpoint (ds_to_universal's "
                                "layout; the tag from latest_universal)")

    UNIMPLEMENTED = {"parallel_write": Off({"pipeline_stage": False}),
                     "writer": None, "checkpoint_serialization": True}


@dataclass(frozen=True)
class TypedSection:
    """``optimizer`` / ``scheduler``: a ``type`` name and its free-form ``params``."""

    type: str = _opt(None, optional(lambda p, v: v if isinstance(v, str) else _not_str(p, v)),
                     "a type name such as AdamW or WarmupLR")
    params: Mapping[str, Any] = _opt(None, optional(lambda p, v: v), "an object of parameters")

    UNIMPLEMENTED = {}  # noqa: RUF012


@dataclass(frozen=True)
class OptimizerSection(TypedSection):
    """``optimizer``: as ``TypedSection``, plus DeepSpeed's ``legacy_fusion`` (fp16 fused path)."""

    UNIMPLEMENTED = {"legacy_fusion": False}  # noqa: RUF012


def _not_str(path: str, value: Any) -> str:
    raise ConfigError(f"must be a string, got {describe(value)}", key=path)


_COMPRESSION = Off({"shared_parameters": _enabled()}, switch="shared_parameters")

# Top-level DeepSpeed keys dslaunch does not implement -> when they are off (DeepSpeed's
# runtime/config.py, constants.py and the feature configs it reads).
UNIMPLEMENTED_KEYS: dict[str, Any] = {
    # monitors, profilers, logging
    # DeepSpeed prints a throughput line by default; dslaunch has no throughput timer.
    "timers": Off({"throughput": Off({"enabled": False, "synchronized": True}, switch="enabled")}),
    "memory_breakdown": False, "dump_state": False, "log_level": None,
    "disable_python_gc": False,  # DeepSpeed 0.19's switch to turn off Python's cyclic GC in training
    # precision and numerics
    "amp": _enabled(), "torch_autocast": _enabled(),
    "data_types": Off({"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None}),
    "fp32_allreduce": False, "disable_allgather": False, "sparse_gradients": False,
    "managed_gradient_accumulation": True,  # dslaunch steps at the accumulation boundary
    # parallelism
    "expert_parallel": _enabled(),
    "seq_parallel_comm_data_type": "fp32",
    "seq_parallel_communication_data_type": "fp32",  # the spelling DeepSpeed's docs use
    "hybrid_engine": _enabled(),
    # model and training techniques
    "sparse_attention": None, "weight_quantization": None,
    "compression_training": Off({"weight_quantization": _COMPRESSION, "activation_quantization": _COMPRESSION,
                                 "sparse_pruning": _COMPRESSION, "row_pruning": _COMPRESSION,
                                 "head_pruning": _COMPRESSION, "channel_pruning": _COMPRESSION,
                                 "layer_reduction": _enabled()}),
    "quantize_training": _enabled(), "eigenvalue": _enabled(), "progressive_layer_drop": _enabled(),
    "curriculum_learning": _enabled(), "data_efficiency": _enabled(),
    "compile": Off({"deepcompile": False}, switch="deepcompile"), "graph_harvesting": False,
    # checkpoint engines
    "nebula": _enabled(), "datastates_ckpt": False, "casync_ckpt": False, "async_load": False,
    # Keys that only tune features rejected above unless off (NVMe/CPU offload, a CPU optimizer
    # under offload, the tensor-core warning DeepSpeed prints): any value changes nothing.
    "zero_force_ds_cpu_optimizer": ANY, "vocabulary_size": ANY,
}


def _explain_auto(cls: type, raw: Mapping[str, Any], prefix: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        f = fields.get(key)  # an unknown key is left to the did-you-mean below
        if value == "auto" and f is not None and not _stage3_only(cls, key) and key not in getattr(cls, "AUTO_OK", ()):
            what = f.metadata["help"]
            default = f" (or remove the key for the default, {f.default!r})"
            raise ConfigError(f"'auto' is a Hugging Face Trainer placeholder that only the Trainer fills "
                              f"in; put {what} here{default}", key=f"{prefix}.{key}" if prefix else key)


def _stage3_only(cls: type, key: str) -> bool:
    return getattr(cls, "STAGE3_ALIASES", {}).get(key, key) in getattr(cls, "STAGE3_ONLY", ())


def parse_section(cls: type, raw: Any, prefix: str) -> Any:
    """Parse ``raw`` (a dict or None) into the frozen dataclass ``cls``.

    Raises:
        ConfigError: naming ``<prefix>.<key>`` for unknown keys (did-you-mean), bad values,
            ``"auto"``, or keys DeepSpeed has but dslaunch does not implement that are not off.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must be an object, got {describe(raw)}", key=prefix)
    _explain_auto(cls, raw, prefix)
    known: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    spelt: dict[str, str] = {}  # setting -> the raw key that gave it
    for raw_key, value in raw.items():
        key = getattr(cls, "STAGE3_ALIASES", {}).get(raw_key, raw_key)
        if spelt.setdefault(key, raw_key) != raw_key:  # else the last spelling would silently win
            raise ConfigError(f"sets the same thing as '{prefix}.{spelt[key]}' (two spellings of one "
                              "setting); keep one", key=f"{prefix}.{raw_key}")
        if key in cls.UNIMPLEMENTED:
            reject_unimplemented(f"{prefix}.{key}", value, cls.UNIMPLEMENTED[key])
        elif value == "auto" and (_stage3_only(cls, key) or key in getattr(cls, "AUTO_OK", ())):
            continue  # the default stands ("auto" is what DeepSpeed's default means there)
        elif key in names or not _stage3_only(cls, key):
            known[key] = value
    fields = {f.name: Option(f.default, f.metadata["check"]) for f in dataclasses.fields(cls)}
    # INERT keys are checked like the others (and suggested for typos), then dropped.
    inert = {key: Option(None, check) for key, check in getattr(cls, "INERT", {}).items()}
    params = check_params(known, {**fields, **inert}, prefix, f"section '{prefix}'")
    return cls(**{key: params[key] for key in fields})
