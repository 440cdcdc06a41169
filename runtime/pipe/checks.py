"""The configurations a pipeline engine refuses, each with one line naming the key: what every
pipeline needs (``check_config``) and what its schedule needs (``check_round_robin`` for 1F1B and
the interleaved schedule, ``check_dualpipev`` for DualPipeV). Torch-free; called before the engine
builds anything, and again for a new batch size (``set_train_batch_size``)."""

from __future__ import annotations

from typing import Any

from dslaunch.errors import AccumulationModeError, ConfigError
from dslaunch.runtime.pipe import schedule as sched

__all__ = ["check_config", "check_round_robin", "check_dualpipev"]


def check_config(model: Any, config: Any) -> None:
    """What any ``PipelineModule`` needs of ``config`` (a ``DeepSpeedConfig``)."""
    stage = config.zero_optimization.stage
    if not config.managed_gradient_accumulation:
        raise AccumulationModeError("false is not supported with pipeline parallelism (a PipelineModule): "
                                    "train_batch() runs the micro batches and ends the window itself; remove "
                                    "the key", key="managed_gradient_accumulation")
    if config.progressive_layer_drop.enabled:
        raise ConfigError("not with a PipelineModule: its stages take no keyword arguments to drop layers by "
                          "(DeepSpeed fails there with a TypeError); set it to false", key="progressive_layer_drop.enabled")
    if stage == 3:
        raise ConfigError("ZeRO stage 3 cannot be combined with pipeline parallelism (a PipelineModule); "
                          "use zero_optimization.stage 0, 1 or 2", key="zero_optimization.stage")
    stages = config.pipeline.stages
    if stages != "auto" and stages != model.num_stages:
        raise ConfigError(f"{stages} differs from the PipelineModule's {model.num_stages} stages; set it to "
                          f"{model.num_stages} or \"auto\"", key="pipeline.stages")
    if stage == 2 and model.tied_comms:
        raise ConfigError("tied layers across stages (TiedLayerSpec) need ZeRO stage 0 or 1 (stage 2 keeps only "
                          "gradient shards, which differ between the stages holding the tie)",
                          key="zero_optimization.stage")


def check_round_robin(model: Any, config: Any) -> None:
    """``pipeline.schedule`` against the module's virtual stages."""
    schedule = sched.SCHEDULES[config.pipeline.schedule]
    if model.virtual_stages > 1 and not schedule.chunks_allowed:
        raise ConfigError(f"\"{config.pipeline.schedule}\" runs one part per stage, but the PipelineModule has "
                          f"virtual_stages={model.virtual_stages}; use \"interleaved\" (or virtual_stages=1)",
                          key="pipeline.schedule")
    if model.virtual_stages > 1 and model.num_stages == 1:
        raise ConfigError("virtual stages need at least 2 pipeline stages (a single stage has nothing to "
                          "interleave with); use \"1f1b\" and virtual_stages=1", key="pipeline.schedule")
    if schedule is sched.InterleavedSchedule and config.gradient_accumulation_steps % model.num_stages:
        raise ConfigError(f"{config.gradient_accumulation_steps} micro batches: the interleaved schedule needs a "
                          f"multiple of the {model.num_stages} pipeline stages", key="gradient_accumulation_steps")


def check_dualpipev(model: Any, config: Any) -> None:
    """A ``DualPipeVModule`` runs DualPipeV whatever ``pipeline.schedule`` says, except a schedule
    it cannot mean; each micro batch visits every rank twice, so at least ``2 * stages`` of them."""
    if config.pipeline.schedule != "1f1b":
        raise ConfigError(f"\"{config.pipeline.schedule}\" does not apply to a DualPipeVModule, which runs the "
                          "DualPipeV schedule; remove the key (or use a PipelineModule)", key="pipeline.schedule")
    if config.gradient_accumulation_steps < 2 * model.num_stages:
        raise ConfigError(f"{config.gradient_accumulation_steps} micro batches: DualPipeV needs at least 2 * "
                          f"{model.num_stages} (twice the pipeline stages)", key="gradient_accumulation_steps")
