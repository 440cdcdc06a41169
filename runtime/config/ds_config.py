"""ds_config: parsed once, at the edge, into typed frozen dataclasses.

``load_config(source, world_size)`` accepts a path (JSON or YAML), a dict, or an argparse
namespace with ``deepspeed_config``, and returns a ``DeepSpeedConfig``. Everything is validated
here, so nothing later reads raw dicts: unknown keys fail with a did-you-mean (DeepSpeed silently
ignores them), wrong types and ranges name the key path, ``"auto"`` and dotted top-level keys that
libraries leave in (``client_forms.py``) fall back to the default or are ignored with a note, an
``"auto"`` without a default (batch sizes, optimizer and scheduler params) says what to put instead,
features DeepSpeed has but dslaunch lacks are reported unless switched off, and the batch triad
``train_batch_size = micro * gradient_accumulation_steps * world_size`` is completed or rejected
with the arithmetic shown. Reading the file and bounding the document's size and depth (for a
dict too) is ``file.py``'s; every number's range is its checker's (``param_schema.py``).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dslaunch.errors import BatchSizeError, ConfigError, did_you_mean, quote
from dslaunch.runtime.config.activation import ActivationCheckpointingConfig
from dslaunch.runtime.config.autotuning import AutotuningConfig
from dslaunch.runtime.config.batch import BATCH_KEYS, batch_triad, elastic_triad
from dslaunch.runtime.config.client_forms import client_forms
from dslaunch.runtime.config.comms_logger import CommsLoggerConfig
from dslaunch.runtime.config.compression import CompressionConfig, parse_compression
from dslaunch.runtime.config.cross_check import cross_check
from dslaunch.runtime.config.curriculum import CurriculumLearningConfig
from dslaunch.runtime.config.data_efficiency import DataEfficiencyConfig
from dslaunch.runtime.config.elasticity import ElasticityConfig
from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig
from dslaunch.runtime.config.file import check_shape, read_config_file
from dslaunch.runtime.config.flops_profiler import FlopsProfilerConfig
from dslaunch.runtime.config.hybrid_engine import HybridEngineConfig
from dslaunch.runtime.config.layout_invariant import LayoutInvariantConfig
from dslaunch.runtime.config.legacy import legacy_forms
from dslaunch.runtime.config.memory_checkpoint import MemoryCheckpointConfig
from dslaunch.runtime.config.monitor import MonitorConfig
from dslaunch.runtime.config.monitors import (
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from dslaunch.runtime.config.param_schema import boolean, choice, describe, integer, number
from dslaunch.runtime.config.pipeline import PipelineConfig
from dslaunch.runtime.config.progressive_layer_drop import ProgressiveLayerDropConfig
from dslaunch.runtime.config.sections import (
    DATA_TYPES_KEYS,
    UNIMPLEMENTED_KEYS,
    Bf16Config,
    CheckpointConfig,
    DataTypesConfig,
    Fp16Config,
    OptimizerSection,
    TypedSection,
    optional,
    parse_section,
    reject_unimplemented,
)
from dslaunch.runtime.config.tensor_parallel import TensorParallelConfig
from dslaunch.runtime.config.torch_autocast import TorchAutocastConfig
from dslaunch.runtime.config.zero import AioConfig, ZeroConfig
from dslaunch.runtime.parallel.from_config import config_dims, data_world_size
from dslaunch.runtime.sparse_attention.config import SparseAttentionConfig
from dslaunch.utils.logging import log_levels

if TYPE_CHECKING:  # the registries import this package's checkers: import them at use
    from dslaunch.runtime.lr_schedules import SchedulerSpec
    from dslaunch.runtime.optim.registry import OptimizerSpec

__all__ = ["DeepSpeedConfig", "DeepSpeedFormConfig", "load_config", "with_batch", "OWN_DEFAULTS", "ZeroConfig", "Fp16Config", "Bf16Config",
           "CheckpointConfig", "TypedSection"]

# Beyond ~3 years a timeout means "never"; larger values overflow datetime.timedelta.
MAX_TIMEOUT_S = 1e8
_SOURCE_TYPES = (str, os.PathLike, Mapping)
_SECTIONS = {"zero_optimization": ZeroConfig, "fp16": Fp16Config, "bf16": Bf16Config, "data_types": DataTypesConfig,
             "checkpoint": CheckpointConfig, "optimizer": OptimizerSection, "scheduler": TypedSection,
             "elasticity": ElasticityConfig, "monitor": MonitorConfig, "aio": AioConfig,
             "activation_checkpointing": ActivationCheckpointingConfig,
             "flops_profiler": FlopsProfilerConfig,
             "tensorboard": TensorBoardConfig, "csv_monitor": CSVConfig, "wandb": WandbConfig,
             "comet": CometConfig, "comms_logger": CommsLoggerConfig,
             "pipeline": PipelineConfig, "autotuning": AutotuningConfig,
             "tensor_parallel": TensorParallelConfig, "memory_checkpoint": MemoryCheckpointConfig,
             "expert_parallel": ExpertParallelConfig, "layout_invariant": LayoutInvariantConfig, "curriculum_learning":
             CurriculumLearningConfig, "torch_autocast": TorchAutocastConfig,
             "progressive_layer_drop": ProgressiveLayerDropConfig, "hybrid_engine": HybridEngineConfig,
             "data_efficiency": DataEfficiencyConfig, "sparse_attention": SparseAttentionConfig}


def _allreduce_op(path: str, value: Any) -> str:
    # DeepSpeed reads it case-blind ("SUM" is "sum")
    op = value.lower() if isinstance(value, str) else value
    if op not in ("mean", "sum"):
        raise ConfigError(f"Invalid gradient_allreduce_op {quote(value)}: use \"mean\" (the default: "
                          "gradients averaged over the data-parallel ranks) or \"sum\"", key=path)
    return op


def _log_level(path: str, value: Any) -> str:
    # DeepSpeed reads it case-blind and keeps it as written (engine.log_level() answers "ERROR")
    if not isinstance(value, str) or value.lower() not in log_levels:
        raise ConfigError(f"must be one of {', '.join(log_levels)} (any case), got {describe(value)}", key=path)
    return value


def _steps_per_print(path: str, value: Any) -> int | None:
    # The one number that may be infinite: accelerate's DeepSpeedPlugin always sets Infinity.
    return None if value == math.inf else integer(1)(path, value)


# Defaults dslaunch keeps different from DeepSpeed 0.19.8 on purpose -> what the note says when the
# config leaves them out (tests/runtime/config/test_defaults.py lists every default side by side).
OWN_DEFAULTS = {
    "steps_per_print": "steps_per_print is 10 when not given (DeepSpeed 0.19.8: no progress line): rank 0 "
                       "prints a progress line every 10 steps; set it to choose",
}

_SCALARS = {
    "train_batch_size": (optional(integer(1)), "an integer: micro batch * accumulation steps * GPUs"),
    "train_micro_batch_size_per_gpu": (optional(integer(1)), "an integer: samples per GPU per micro step"),
    "gradient_accumulation_steps": (optional(integer(1)), "an integer: micro steps per optimizer step"),
    "managed_gradient_accumulation": (boolean, "true (the engine counts the micro steps) or false (every step() is one)"),
    "disable_python_gc": (boolean, "true: Python's cyclic GC off while the engine lives (engine.collect_python_gc())"),
    "steps_per_print": (_steps_per_print, "an integer: log every N optimizer steps"),
    "wall_clock_breakdown": (boolean, "true or false"),
    "gradient_clipping": (number(0.0), "a number: max global gradient norm (0 = off)"),
    "prescale_gradients": (boolean, "true or false"),
    "gradient_predivide_factor": (number(0.0, low_open=True), "a number > 0"),
    "gradient_allreduce_op": (_allreduce_op, "\"mean\" or \"sum\""),
    "sequence_parallel_size": (integer(1), "an integer >= 1: ranks that split each sequence (Ulysses)"),
    "communication_data_type": (optional(choice("fp32", "fp16", "bf16")), "fp32, fp16 or bf16"),
    # not DeepSpeed's: node-local reduce, cross-node all-reduce, broadcast (runtime/zero/exchange.py)
    "hierarchical_allreduce": (choice("topology", "always", "never"), "topology, always or never"),
    # not DeepSpeed's: the ZeRO collectives through /dev/shm when every rank is on one host (runtime/zero/shm.py)
    "shared_memory_collectives": (choice("on", "never"), "on (the default) or never"),
    # DeepSpeed refuses client optimizers it has not tested with ZeRO unless this is true; dslaunch
    # refuses client optimizers that are not element-wise (engine_setup._checked_client).
    "zero_allow_untested_optimizer": (boolean, "true or false"),
    "dataloader_drop_last": (boolean, "true or false"),
    "log_level": (optional(_log_level), "debug, info, warning, error or critical: the DeepSpeed logger's level"),
    "use_data_before_expert_parallelism": (boolean, "true or false"),
    "dist_init_timeout": (number(0.0, MAX_TIMEOUT_S, low_open=True), "seconds to wait for peers (default 1800)"),
    # DeepSpeed's examples state it beside tensor_parallel / sequence_parallel_size: checked, not used
    "data_parallel_size": (optional(integer(1)), "an integer: the data-parallel ranks (world / model-parallel ranks)"),
}


def _data_parallel_size(mpu: Any) -> int:
    """DeepSpeed's world for the batch triad: the model-parallel unit's data-parallel ranks, else
    the process group's, else 1 (no group yet)."""
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    import torch.distributed as dist  # only this constructor form needs torch

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _ConfigType(type):
    """Lets ``DeepSpeedConfig`` also be called as DeepSpeed's class is: ``DeepSpeedConfig(config,
    mpu=None, mesh_device=None)`` with a dict or a path parses it (``load_config``) for the
    data-parallel world of ``mpu`` or of the process group, into a ``DeepSpeedFormConfig``."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        source = args[0] if args else kwargs.get("config")
        if isinstance(source, _SOURCE_TYPES) and len(args) <= 3 and set(kwargs) <= {"config", "mpu", "mesh_device"}:
            mpu = args[1] if len(args) > 1 else kwargs.get("mpu")
            cfg = load_config(source, _data_parallel_size(mpu), global_world=mpu is None)
            return DeepSpeedFormConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})
        return super().__call__(*args, **kwargs)


@dataclass(frozen=True)
class DeepSpeedConfig(metaclass=_ConfigType):
    """The whole validated ds_config; batch sizes are resolved for ``world_size``.

    ``DeepSpeedConfig(config_dict_or_path, mpu=None)`` parses a config as DeepSpeed's class does;
    the fields are the parsed values (``load_config``).
    """

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int
    managed_gradient_accumulation: bool = True
    """False: the script owns the accumulation boundary, every ``step()`` is one (DeepSpeed 0.19's key;
    ``gradient_accumulation_steps`` then only divides the loss and sizes ``train_batch_size``)."""
    steps_per_print: int | None = 10
    """None: never (accelerate writes Infinity there to silence DeepSpeed's log)."""
    wall_clock_breakdown: bool = False
    gradient_clipping: float = 1.0
    """DeepSpeed 0.19.8's default (``GRADIENT_CLIPPING_DEFAULT``): clip at a global norm of 1.0; 0: off."""
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    gradient_allreduce_op: str = "mean"
    """How data-parallel gradients combine: averaged ("mean", DeepSpeed's default) or summed ("sum":
    each rank's gradients add up, as if the batch's losses were summed; not at ZeRO stage 3)."""
    sequence_parallel_size: int = 1
    """Ranks that split each sample's sequence (Ulysses, ``runtime/sequence_parallel``); they read the
    same samples, so the batch triad counts ``world / sequence_parallel_size`` data-parallel ranks."""
    communication_data_type: str | None = None
    hierarchical_allreduce: str = "topology"
    """Gradient all-reduce within nodes first where ranks share nodes (not DeepSpeed's key)."""
    shared_memory_collectives: str = "on"  # see docs/zero-offload.md
    """The ZeRO engine's gradient reductions, shard publish and stage 3 gathers through shared memory
    where every data-parallel rank runs on this host on gloo ("on", the default; "auto" too), or never
    ("never"). ``DSLAUNCH_SHM_COLLECTIVES`` overrides it: ``0`` off, ``1`` on. Not DeepSpeed's key."""
    zero_allow_untested_optimizer: bool = False
    dataloader_drop_last: bool = False
    log_level: str | None = None
    """The DeepSpeed logger's level from ``initialize`` on (None: left as it is)."""
    use_data_before_expert_parallelism: bool = False
    """Expert groups laid out D + E instead of E + D (DeepSpeed's MoE ``set_deepspeed_parallelism``)."""
    dist_init_timeout: float = 1800.0
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    fp16: Fp16Config = field(default_factory=Fp16Config)
    bf16: Bf16Config = field(default_factory=Bf16Config)
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    grad_accum_dtype, param_dtype, buffer_dtype, keep_in_fp32_modules = (  # DeepSpeed's names on its config
        property(lambda self, k=k: getattr(self.data_types, k)) for k in DATA_TYPES_KEYS)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elasticity: ElasticityConfig = field(default_factory=ElasticityConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """dslaunch's own block: the launcher reads it (``monitor.py``); validated here too."""
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    """Read by ``deepspeed.checkpointing`` (``initialize`` configures it when the block is given)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Read only when the model is a ``PipelineModule`` (``runtime/pipe/engine.py``)."""
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = field(default_factory=CSVConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    comet: CometConfig = field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    autotuning: AutotuningConfig = field(default_factory=AutotuningConfig)
    """Read by ``dslaunch --autotuning`` and, inside an experiment, by the engine's profiler."""
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    """AutoTP training: ``autotp_size`` ranks split each layer (``runtime/tensor_parallel/``)."""
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    """AutoEP: a Hugging Face MoE model's experts spread over ``autoep_size`` ranks (``runtime/moe/autoep.py``)."""
    memory_checkpoint: MemoryCheckpointConfig = field(default_factory=MemoryCheckpointConfig)
    """dslaunch's own block: snapshots in host memory a restart resumes from (``checkpoint/memory.py``)."""
    layout_invariant: LayoutInvariantConfig = field(default_factory=LayoutInvariantConfig)
    """dslaunch's own block: reductions in one fixed order at any tensor, expert or data degree."""
    curriculum_learning: CurriculumLearningConfig = field(default_factory=CurriculumLearningConfig)
    data_efficiency: DataEfficiencyConfig = field(default_factory=DataEfficiencyConfig)
    """Curriculum learning by data sampling (``runtime/data_pipeline/data_sampling/``)."""
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig)
    """Forwards under ``torch.autocast`` (``runtime/torch_autocast.py``)."""
    progressive_layer_drop: ProgressiveLayerDropConfig = field(default_factory=ProgressiveLayerDropConfig)
    compression_training: CompressionConfig = field(default_factory=CompressionConfig)
    """DeepSpeed Compression's techniques (``runtime/compression/``; 0.19.8 removed the library)."""
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    """Training and generating with one engine (``runtime/hybrid_engine.py``)."""
    sparse_attention: SparseAttentionConfig | None = None
    """The block-sparse attention layout for the model code to build (None: no section), as
    DeepSpeed 0.19.7 keeps it; ``.as_dict()`` is DeepSpeed's dict (``runtime/sparse_attention/``)."""
    disable_python_gc: bool = False
    """Python's cyclic garbage collector off while the engine lives (``runtime/python_gc.py``)."""
    optimizer: OptimizerSpec | None = None
    """The ``optimizer`` section, validated (type and complete params) when the config is parsed."""
    scheduler: SchedulerSpec | None = None
    source: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The config as given (a dict or the file's content): DeepSpeed's ``engine.config``."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """Lines for the user about what was read differently from what was written (unfilled
    ``"auto"``, dotted keys: ``client_forms.py``) and about defaults unlike DeepSpeed's in effect
    (``OWN_DEFAULTS``); ``initialize`` prints them once on rank 0."""

    @property
    def monitor_config(self) -> DeepSpeedMonitorConfig:
        """DeepSpeed's name for the four monitor blocks together (``MonitorMaster`` takes it)."""
        return DeepSpeedMonitorConfig(self.tensorboard, self.wandb, self.csv_monitor, self.comet)


class DeepSpeedFormConfig(DeepSpeedConfig):
    """What ``DeepSpeedConfig(config, mpu)`` returns: the parsed config, whose three batch sizes may
    be assigned and completed again by ``_configure_train_batch_size()``, as on DeepSpeed's object
    (code written against DeepSpeed's config sets them and re-resolves). Every other field stays
    frozen, and the engine never holds one of these: ``initialize`` parses its own.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in BATCH_KEYS:
            super().__setattr__(name, value)  # FrozenInstanceError, as on any DeepSpeedConfig
        object.__setattr__(self, name, value)

    def _configure_train_batch_size(self) -> None:
        """Complete the assigned batch sizes for ``world_size`` with the same rules as parsing.

        Raises:
            BatchSizeError: (also an ``AssertionError``, as DeepSpeed's) a value that is not a
                positive integer, neither ``train_batch_size`` nor the micro batch set, or sizes
                that do not add up; the batch sizes are left as assigned.
        """
        for key, value in _checked_triad({k: getattr(self, k) for k in BATCH_KEYS}, self.world_size).items():
            object.__setattr__(self, key, value)


def with_batch(cfg: DeepSpeedConfig, **sizes: int | None) -> DeepSpeedConfig:
    """``cfg`` with its batch triad completed anew from ``sizes`` (any of ``train_batch_size``,
    ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``) for its ``world_size``,
    by the rules of parsing.

    Raises:
        BatchSizeError: a size that is not a positive integer, or sizes that do not add up.
    """
    unknown = set(sizes) - set(BATCH_KEYS)
    if unknown:
        raise TypeError(f"with_batch() takes only {', '.join(BATCH_KEYS)}, not {', '.join(sorted(unknown))}")
    return replace(cfg, **_checked_triad({k: sizes.get(k) for k in BATCH_KEYS}, cfg.world_size))


def _checked_triad(given: dict[str, Any], world: int) -> dict[str, int]:
    """Each given size checked as when parsed, then ``batch.batch_triad``; every error a ``BatchSizeError``."""
    try:
        return batch_triad({k: None if v is None else _scalar(k, v) for k, v in given.items()}, world)
    except ConfigError as err:  # a value's checker: DeepSpeed asserts there too
        raise BatchSizeError(str(err)) from None


def load_config(source: Any, world_size: int, global_world: bool = True) -> DeepSpeedConfig:
    """Parse and validate a ds_config.

    Args:
        source: a path (str/Path, JSON or YAML), a dict, or an object with ``deepspeed_config``.
        world_size: the job's ranks (``global_world``) or an mpu's data-parallel ranks, to resolve
            the batch triad.
        global_world: ``world_size`` counts every rank (no mpu): the model-parallel degrees the
            config sets itself (``tensor_parallel.autotp_size``, ``sequence_parallel_size``) must
            divide it, and the sequence ranks of a sample count once in the batch triad (they read
            the same samples); tensor slices count each, as DeepSpeed's config does without an mpu.

    Returns:
        The validated ``DeepSpeedConfig``.

    Raises:
        ConfigError: a source that is neither a dict nor a path, an unreadable or malformed file,
            a document too large or too deep, unknown key, bad value (non-finite or out of range
            included), ``"auto"``, unimplemented feature, inconsistent batch sizes; one line
            naming the file and the key path.
    """
    raw, where = _read(source)
    try:
        return _parse(raw, world_size, where, global_world)
    except ConfigError as err:
        if where and not err.source:
            raise ConfigError(str(err), source=where) from None
        raise


def _read(source: Any) -> tuple[Mapping[str, Any], str | None]:
    if isinstance(source, argparse.Namespace) or hasattr(source, "deepspeed_config"):
        source = getattr(source, "deepspeed_config", None)
    if source is None or source == "":
        raise ConfigError("no DeepSpeed config given: pass config=<dict or path> to initialize(), or "
                          "--deepspeed_config <path> on the command line")
    if not isinstance(source, _SOURCE_TYPES):
        raise ConfigError("initialize(config=...) takes a dict or a path to a JSON/YAML file, got "
                          f"{describe(source)}")
    where = None if isinstance(source, Mapping) else str(source)
    raw = source if isinstance(source, Mapping) else read_config_file(Path(source))
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must hold an object of settings ({{\"key\": value, ...}}), got {describe(raw)}",
                          source=where)
    check_shape(raw, where)
    return raw, where


def _parse(raw: Mapping[str, Any], world_size: int, where: str | None, global_world: bool = True
           ) -> DeepSpeedConfig:
    raw = legacy_forms(raw)
    # The batch sizes have no default for an unfilled "auto" to fall back on: they stay errors.
    forms = client_forms(raw, _SECTIONS, {k: v for k, v in _SCALARS.items() if k not in BATCH_KEYS})
    values: dict[str, Any] = {}
    for key, value in forms.raw.items():
        if key in _SECTIONS:
            values[key] = parse_section(_SECTIONS[key], value, key)
        elif key == "compression_training":  # free-form group names: its own parser
            values[key] = parse_compression(value)
        elif key in _SCALARS:
            values[key] = _scalar(key, value)
        elif key in UNIMPLEMENTED_KEYS:
            reject_unimplemented(key, value, UNIMPLEMENTED_KEYS[key])
        else:
            valid = [*_SECTIONS, *_SCALARS, "compression_training"]
            hint = did_you_mean(str(key), [*valid, *UNIMPLEMENTED_KEYS])
            raise ConfigError(f"unknown key{hint}; valid top-level keys: {_listing(sorted(valid))}",
                              key=str(key))
    _validate_typed(values)
    data = world_size
    if global_world:
        dims = config_dims(values.get("tensor_parallel"), values.get("sequence_parallel_size", 1))
        data = data_world_size(dims, world_size)
        # DeepSpeed without an mpu: train_batch_size = micro * gas * world / sequence_parallel_size
        world_size //= dims.sequence
    stated = values.pop("data_parallel_size", None)
    if stated is not None and stated != data:
        raise ConfigError(f"{stated} but the job has {data} data-parallel ranks (the world divided by the "
                          "model-parallel degrees); fix it or remove the key", key="data_parallel_size")
    given = {k: values.pop(k, None) for k in BATCH_KEYS}
    elastic = values.get("elasticity")
    triad = (elastic_triad(elastic, given, world_size) if elastic is not None and elastic.enabled
             else batch_triad(given, world_size))
    notes = (*forms.notes, *(note for key, note in OWN_DEFAULTS.items() if key not in forms.raw))
    cfg = DeepSpeedConfig(**triad, world_size=world_size, source=where, raw=raw, notes=notes, **values)
    cross_check(cfg)
    return cfg


def _scalar(key: str, value: Any) -> Any:
    check, help_text = _SCALARS[key]
    if value == "auto":
        raise ConfigError("'auto' is a Hugging Face Trainer placeholder that only the Trainer fills in; "
                          f"put {help_text} here", key=key)
    return check(key, value)


def _listing(names: list[str], limit: int = 300) -> str:
    """``names`` joined, cut to about ``limit`` characters (every new section lengthens the list:
    an error line stays short)."""
    shown: list[str] = []
    for name in names:
        if sum(len(n) + 2 for n in shown) + len(name) > limit:
            return f"{', '.join(shown)} and {len(names) - len(shown)} more"
        shown.append(name)
    return ", ".join(shown)


def _validate_typed(values: dict[str, Any]) -> None:
    """The ``optimizer`` and ``scheduler`` sections -> their validated specs, in place: the
    optimizer and scheduler builders take the spec and never check a dict again."""
    from dslaunch.runtime.lr_schedules import validate_lr_scheduler
    from dslaunch.runtime.optim.registry import validate_optimizer

    for key, example, validate in (("optimizer", "AdamW", validate_optimizer),
                                   ("scheduler", "WarmupLR", validate_lr_scheduler)):
        section = values.get(key)
        if section is None:
            continue
        if section.type is None:
            raise ConfigError(f"is required (e.g. \"{example}\")", key=f"{key}.type")
        values[key] = validate(section.type, section.params)
