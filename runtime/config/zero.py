"""The ``zero_optimization`` section (``ZeroConfig``), its offload sections (``OffloadConfig``),
the ``aio`` section, and DeepSpeed's older spellings of offload (``legacy_zero_forms``).

Parsed by ``sections.parse_section`` like every section; ``runtime.zero.config`` answers DeepSpeed's
``DeepSpeedZeroConfig`` from here. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dslaunch.errors import BucketAlignmentError, ConfigError
from dslaunch.runtime.config.param_schema import boolean, choice, describe, integer, number
from dslaunch.runtime.config.sections import ANY, _only, _opt, optional, parse_section
from dslaunch.runtime.zero.registry import stage_choices

__all__ = ["ZeroConfig", "OffloadConfig", "AioConfig", "LeafModuleConfig", "offload_optimizer_section",
           "offload_param_section", "legacy_zero_forms", "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES",
           "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]


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


# Hugging Face MoE blocks run their experts in a data-dependent order: DeepSpeed flags them as ZeRO-3
# leaf modules unless the config says otherwise (its defaults, by the same names).
DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


def _names(path: str, value: Any) -> list[str]:
    """A string or a list of strings, as a list without repeats (DeepSpeed's coercion)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) and v for v in items):
        raise ConfigError(f"must be a name or a list of names, e.g. [\"experts\"], got {describe(value)}", key=path)
    return list(dict.fromkeys(items))


@dataclass(frozen=True)
class LeafModuleConfig:
    """``zero_optimization.leaf_module``: modules ZeRO-3 gathers whole on entry (their children's
    parameters with them), by class, by ``named_modules()`` name, or by name suffix; applied when
    the engine is built (``runtime/zero/leaf_modules.py``)."""

    classes: list[str] = field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES),
                               metadata={"check": _names, "help": "class names, plain or with their module, "
                                         "e.g. [\"MyMoEBlock\"]"})
    names: list[str] = field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES),
                             metadata={"check": _names, "help": "module names as named_modules() gives them, "
                                       "e.g. [\"model.layers.0.mlp\"]"})
    name_suffixes: list[str] = field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES),
                                     metadata={"check": _names, "help": "endings of module names, e.g. [\"experts\"]"})
    UNIMPLEMENTED: ClassVar[dict[str, Any]] = {}

    @property
    def customized(self) -> bool:
        """Whether the config changed any of DeepSpeed's defaults (then a miss is worth a warning)."""
        return (self.classes != DEFAULT_LEAF_MODULE_CLASSES or self.names != DEFAULT_LEAF_MODULE_NAMES
                or self.name_suffixes != DEFAULT_LEAF_MODULE_NAME_SUFFIXES)


def _leaf_module(path: str, value: Any) -> LeafModuleConfig:
    return parse_section(LeafModuleConfig, {} if value is None else value, path)


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
    contiguous_gradients: bool = _opt(True, boolean, "true or false (no effect: gradients are always copied "
                                      "into contiguous buffers)")
    """Memory-layout knob, no effect on results: dslaunch always copies gradients into contiguous
    buffers (one flat buffer per param group at stages 0-1, the reduce buckets at stage 2), so
    either value trains the same; DeepSpeed's own stage 1 ignores it too."""
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
    leaf_module: LeafModuleConfig = _opt(LeafModuleConfig(), _leaf_module, "an object such as "
                                         "{\"classes\": [\"MyMoEBlock\"]} (stage 3)")

    # DeepSpeed keys not implemented here -> when they are off.
    def __post_init__(self) -> None:
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if self.stage in (1, 2) and self.allgather_bucket_size % 2:
            # DeepSpeed's stage 1/2 optimizer asserts it (buckets start 4-byte aligned in 16-bit
            # elements); refused here too, so a config that runs on dslaunch runs on DeepSpeed.
            raise BucketAlignmentError(
                f"allgather_bucket_size must be a multiple of nccl_start_alignment_factor (2) at ZeRO stages "
                f"1 and 2, got {self.allgather_bucket_size}; use an even number such as "
                f"{self.allgather_bucket_size - 1}", key="zero_optimization.allgather_bucket_size")
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
                     "legacy_stage1": False, "enable_sanity_checks": False, "zeropp_loco_param": None}
    # Keys that only configure stage 3 (after STAGE3_ALIASES) and dslaunch does not read (the
    # fields above excepted): any value accepted, "auto" included (the Hugging Face Trainer writes
    # it there). Whole names, not prefixes: a misspelt one must get "did you mean".
    STAGE3_ONLY = frozenset((
        "sub_group_size", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "model_persistence_threshold", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
        "allgather_sequential", "partition_stream_chunk_size", "log_trace_cache_warnings",
        "pipeline_loading_checkpoint", "override_module_apply", "memory_efficient_linear",
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
