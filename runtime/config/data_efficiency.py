"""The ds_config ``data_efficiency`` section: DeepSpeed's curriculum learning by data sampling.

``{"data_efficiency": {"enabled": true, "seed": 1234, "data_sampling": {"enabled": true,
"num_epochs": 1, "curriculum_learning": {"enabled": true, "data_cluster_path": "clusters",
"curriculum_metrics": {"seqlen": {"index_to_sample_path": "an/seqlen_index_to_sample",
"index_to_metric_path": "an/seqlen_index_to_metric", "difficulty_type": "value",
"clustering_type": "schedule_based", "min_difficulty": 8, "max_difficulty": 64,
"schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 100,
"difficulty_step": 8}}}}}}}``

Each metric's difficulty rises with the step on the legacy curriculum's schedules
(``runtime/config/curriculum.py``); the sampler (``runtime/data_pipeline/data_sampling/
data_sampler.py``) draws each global batch from the samples whose metric is within the
difficulty reached: by value (``difficulty_type`` "value", files from ``DataAnalyzer``) or by
percentile of the data sorted by the metric ("percentile"). A ``single_cluster`` metric is not
read from files (all samples qualify).

As in DeepSpeed, the sampler is on when ``data_sampling.curriculum_learning.enabled`` is true
(the outer ``enabled`` flags are read and kept, as DeepSpeed keeps them). ``data_routing.random_ltd`` configures random-LTD (``runtime/data_pipeline/data_routing/``),
``data_sampling.dynamic_batching`` the variable batch size loader
(``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``). Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.curriculum import SCHEDULE_TYPES, Schedule, parse_schedule
from dslaunch.runtime.config.param_schema import (
    REQUIRED,
    Option,
    boolean,
    check_params,
    choice,
    describe,
    integer,
)
from dslaunch.runtime.config.sections import _opt, optional, parse_section

__all__ = ["DataEfficiencyConfig", "DataSamplingConfig", "CurriculumSamplingConfig", "CurriculumMetricConfig",
           "DataRoutingConfig", "RandomLtdConfig", "DynamicBatchingConfig", "DIFFICULTY_TYPES", "CLUSTERING_TYPES"]

_KEY = "data_efficiency"
DIFFICULTY_TYPES = ("value", "percentile")
CLUSTERING_TYPES = ("schedule_based", "single_cluster")


def _path(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"must be a file path prefix (a string), got {describe(value)}", key=path)
    return value


def _settings(path: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"must be an object of the schedule's settings, got {describe(value)}", key=path)
    return dict(value)


@dataclass(frozen=True)
class CurriculumMetricConfig:
    """One entry of ``curriculum_metrics``: where its index files are and how its difficulty rises."""

    index_to_sample_path: str | None = _opt(None, optional(_path), "the analyzer's <metric>_index_to_sample prefix")
    index_to_metric_path: str | None = _opt(None, optional(_path), "the analyzer's <metric>_index_to_metric prefix")
    difficulty_type: str = _opt("value", choice(*DIFFICULTY_TYPES), "value or percentile")
    clustering_type: str = _opt("schedule_based", choice(*CLUSTERING_TYPES), "schedule_based or single_cluster")
    min_difficulty: int | None = _opt(None, optional(integer(0)), "an integer: the first step's difficulty")
    max_difficulty: int | None = _opt(None, optional(integer(0)), "an integer: the difficulty at the schedule's end")
    schedule_type: str | None = _opt(None, optional(choice(*SCHEDULE_TYPES)), "one of " + ", ".join(SCHEDULE_TYPES))
    schedule_config: Mapping[str, Any] | None = _opt(None, optional(_settings), "the schedule's settings")

    UNIMPLEMENTED = {}  # noqa: RUF012

    def checked(self, prefix: str) -> Schedule:
        """The metric's schedule, every key it needs there.

        Raises:
            ConfigError: a required key missing, min above max, a bad ``schedule_config``.
        """
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(self, key) is None:
                raise ConfigError("is required for a curriculum metric", key=f"{prefix}.{key}")
        if self.min_difficulty > self.max_difficulty:
            raise ConfigError(f"{self.min_difficulty} is above max_difficulty {self.max_difficulty}",
                              key=f"{prefix}.min_difficulty")
        if self.clustering_type != "single_cluster":
            needed = ("index_to_sample_path",) + ("index_to_metric_path",) * (self.difficulty_type == "value")
            for key in needed:
                if getattr(self, key) is None:
                    raise ConfigError(f"is required for a {self.difficulty_type}-based, {self.clustering_type} metric "
                                      "(DataAnalyzer writes it)", key=f"{prefix}.{key}")
        if self.difficulty_type == "percentile" and self.max_difficulty > 100:
            raise ConfigError(f"{self.max_difficulty} is above 100 for a percentile-based metric",
                              key=f"{prefix}.max_difficulty")
        return parse_schedule(self.schedule_type, self.schedule_config, prefix)

    def schedule_block(self) -> dict[str, Any]:
        """The keys the curriculum scheduler takes."""
        return {"min_difficulty": self.min_difficulty, "max_difficulty": self.max_difficulty,
                "schedule_type": self.schedule_type, "schedule_config": dict(self.schedule_config or {})}


def _metrics(path: str, value: Any) -> Mapping[str, CurriculumMetricConfig]:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"must be an object of metric name -> its settings, got {describe(value)}", key=path)
    return {str(name): parse_section(CurriculumMetricConfig, block, f"{path}.{name}") for name, block in value.items()}


@dataclass(frozen=True)
class CurriculumSamplingConfig:
    """``data_sampling.curriculum_learning``: batches drawn from the samples easy enough so far."""

    enabled: bool = _opt(False, boolean, "true or false")
    data_cluster_path: str | None = _opt(None, optional(_path), "a directory for the sampler's cluster files")
    curriculum_metrics: Mapping[str, CurriculumMetricConfig] | None = _opt(None, optional(_metrics), "metric name -> its settings")

    UNIMPLEMENTED = {}  # noqa: RUF012


def _section(cls: type) -> Any:
    return lambda path, value: parse_section(cls, value, path)


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """``data_sampling.dynamic_batching``: batches of up to ``max_tokens`` tokens, the LR scaled to
    each batch's size (``variable_batch_size_and_lr.py``)."""

    enabled: bool = _opt(False, boolean, "true or false")
    metrics_path: str | None = _opt(None, optional(_path), "the analyzer's directory (with seqlen/)")
    lr_scaling_method: str = _opt("linear", choice("linear", "sqrt", "none"), "linear, sqrt or none")
    min_batch_size: int = _opt(1, integer(1), "an integer: the fewest samples of a micro batch")
    max_batch_size: int | None = _opt(None, optional(integer(1)), "an integer: the most samples of a micro batch")
    sequence_picking_order: str = _opt("dataloader", choice("dataloader", "random", "seqlen"),
                                       "dataloader, random or seqlen")
    max_tokens: int | None = _opt(None, optional(integer(1)), "an integer: the most tokens of a micro batch")
    verbose: bool = _opt(False, boolean, "true or false")

    UNIMPLEMENTED = {}  # noqa: RUF012


@dataclass(frozen=True)
class DataSamplingConfig:
    """``data_efficiency.data_sampling``."""

    enabled: bool = _opt(False, boolean, "true or false")
    num_epochs: int = _opt(1000, integer(1), "an integer: epochs of the data the sampler draws from in all")
    num_workers: int = _opt(0, integer(0), "an integer: the DataLoader's worker processes")
    pin_memory: bool = _opt(False, boolean, "true or false")
    curriculum_learning: CurriculumSamplingConfig = _opt(CurriculumSamplingConfig(), _section(CurriculumSamplingConfig),
                                                         "the curriculum's settings")
    dynamic_batching: DynamicBatchingConfig = _opt(DynamicBatchingConfig(), _section(DynamicBatchingConfig),
                                                   "batching by a token budget")

    UNIMPLEMENTED = {}  # noqa: RUF012


def _ltd_schedule(path: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"must be an object (min_value, max_value, schedule_type, schedule_config), got "
                          f"{describe(value)}", key=path)
    params = check_params(value, {"min_value": Option(REQUIRED, integer(1)), "max_value": Option(REQUIRED, integer(1)),
                                  "schedule_type": Option("fixed_linear", choice("fixed_linear")),
                                  "schedule_config": Option(REQUIRED, _ltd_steps)}, path, "random_ltd_schedule")
    if params["min_value"] > params["max_value"]:
        raise ConfigError(f"{params['min_value']} is above max_value {params['max_value']}", key=f"{path}.min_value")
    return params


def _ltd_steps(path: str, value: Any) -> Mapping[str, Any]:
    return check_params(value, {"require_steps": Option(REQUIRED, integer(1)),
                                "seq_per_step": Option(REQUIRED, integer(1))}, path, "schedule 'fixed_linear'")


def _layer_ids(path: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"must be a non-empty list of layer numbers, got {describe(value)}", key=path)
    return tuple(integer(0)(f"{path}[{i}]", v) for i, v in enumerate(value))


@dataclass(frozen=True)
class RandomLtdConfig:
    """``data_routing.random_ltd``: the layers named drop tokens at random while training."""

    enabled: bool = _opt(False, boolean, "true or false")
    total_layer_num: int | None = _opt(None, optional(integer(1)), "an integer: the model's layers")
    random_ltd_layer_num: int | None = _opt(None, optional(integer(1)), "an integer: the layers that drop tokens")
    random_ltd_layer_id: tuple[int, ...] | None = _opt(None, optional(_layer_ids), "a list of their layer numbers")
    model_mask_name: str | None = _opt(None, optional(_path), "the layer forward's attention-mask keyword")
    model_type: str = _opt("decoder", choice("decoder", "encoder"), "decoder or encoder")
    hidden_state_order: str = _opt("batch_seq_dim", choice("batch_seq_dim", "seq_batch_dim"),
                                   "batch_seq_dim or seq_batch_dim")
    random_ltd_schedule: Mapping[str, Any] | None = _opt(None, optional(_ltd_schedule), "the kept length's schedule")
    layer_token_lr_schedule: Mapping[str, Any] | None = _opt(None, optional(_settings), "not implemented: enabled false")

    UNIMPLEMENTED = {}  # noqa: RUF012

    def check(self, prefix: str) -> None:
        """Every key an enabled block needs.

        Raises:
            ConfigError: naming the key.
        """
        if not self.enabled:
            return
        for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "random_ltd_schedule"):
            if getattr(self, key) is None:
                raise ConfigError("is required with random-LTD enabled", key=f"{prefix}.{key}")
        if len(self.random_ltd_layer_id) != self.random_ltd_layer_num:
            raise ConfigError(f"names {len(self.random_ltd_layer_id)} layers but random_ltd_layer_num is "
                              f"{self.random_ltd_layer_num}", key=f"{prefix}.random_ltd_layer_id")
        if (self.layer_token_lr_schedule or {}).get("enabled"):
            raise ConfigError("is accepted by DeepSpeed but not implemented (DeepSpeed's raises "
                              "NotImplementedError too); set it to false",
                              key=f"{prefix}.layer_token_lr_schedule.enabled")

    def as_dict(self, micro_batch_size: int, global_batch_size: int) -> dict[str, Any]:
        """DeepSpeed's dict of the block, with the batch sizes its engine adds."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["random_ltd_layer_id"] = list(self.random_ltd_layer_id or ())
        out["layer_token_lr_schedule"] = dict(self.layer_token_lr_schedule or {"enabled": False})
        return {**out, "micro_batch_size": micro_batch_size, "global_batch_size": global_batch_size}


@dataclass(frozen=True)
class DataRoutingConfig:
    """``data_efficiency.data_routing``."""

    enabled: bool = _opt(False, boolean, "true or false")
    random_ltd: RandomLtdConfig = _opt(RandomLtdConfig(), lambda path, value: parse_section(RandomLtdConfig, value, path),
                                       "random-LTD")

    UNIMPLEMENTED = {}  # noqa: RUF012


@dataclass(frozen=True)
class DataEfficiencyConfig:
    """``data_efficiency``: DeepSpeed's data-efficiency library (here: curriculum data sampling)."""

    enabled: bool = _opt(False, boolean, "true or false")
    seed: int = _opt(1234, integer(0, 2**63 - 1), "an integer: the sampler's numpy seed")
    data_sampling: DataSamplingConfig = _opt(DataSamplingConfig(), _section(DataSamplingConfig), "data sampling")
    data_routing: DataRoutingConfig = _opt(DataRoutingConfig(), _section(DataRoutingConfig), "data routing")

    UNIMPLEMENTED = {}  # noqa: RUF012

    @property
    def curriculum(self) -> CurriculumSamplingConfig:
        return self.data_sampling.curriculum_learning

    @property
    def curriculum_enabled(self) -> bool:
        """Whether ``deepspeed_io`` samples by curriculum (DeepSpeed's rule: the innermost flag)."""
        return self.curriculum.enabled

    @property
    def random_ltd_enabled(self) -> bool:
        """Whether the engine runs random-LTD (DeepSpeed's rule: ``random_ltd.enabled`` alone)."""
        return self.data_routing.random_ltd.enabled

    def check(self) -> None:
        """Consistency of an enabled curriculum (each metric's schedule and files, the cluster path)
        and of an enabled random-LTD.

        Raises:
            ConfigError: naming the key.
        """
        self.data_routing.random_ltd.check(f"{_KEY}.data_routing.random_ltd")
        batching = self.data_sampling.dynamic_batching
        if batching.enabled and batching.max_tokens is None:
            raise ConfigError("is required with dynamic batching enabled (the most tokens of a micro batch, e.g. 8192)",
                              key=f"{_KEY}.data_sampling.dynamic_batching.max_tokens")
        if not self.curriculum_enabled:
            return
        prefix = f"{_KEY}.data_sampling.curriculum_learning"
        if not self.curriculum.curriculum_metrics:
            raise ConfigError("is required with curriculum learning enabled (metric name -> its settings)",
                              key=f"{prefix}.curriculum_metrics")
        if self.curriculum.data_cluster_path is None:
            raise ConfigError("is required with curriculum learning enabled (a directory the sampler writes its "
                              "cluster files to)", key=f"{prefix}.data_cluster_path")
        for name, metric in self.curriculum.curriculum_metrics.items():
            metric.checked(f"{prefix}.curriculum_metrics.{name}")
