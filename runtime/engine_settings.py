"""DeepSpeed's engine getters of its settings (``engine.fp16_enabled()``, ``engine.train_batch_size()``,
...): what the config and the engine's parts answer, under DeepSpeed's names."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from dslaunch.runtime.torch_autocast import get_default_autocast_lower_precision_modules

__all__ = ["EngineSettings"]

# DeepSpeed lower-cases these optimizer types in ``engine.optimizer_name()`` (its DEEPSPEED_OPTIMIZERS)
_LOWERED_OPTIMIZERS = frozenset({"adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon"})
# ``dynamic_loss_scale_args()``'s keys: DeepSpeed's loss scaler's keyword names
_SCALER_ARGS = {"scale_window": "loss_scale_window", "delayed_shift": "hysteresis",
                "consecutive_hysteresis": "consecutive_hysteresis", "min_scale": "min_loss_scale"}


def _reads(path: str) -> Callable[[Any], Any]:
    """An engine method that returns the parsed config's value at ``path``, as DeepSpeed's getter of
    that name returns its config's (``engine.zero_reduce_bucket_size()``)."""
    attrs = path.split(".")

    def getter(self: Any) -> Any:
        value = self._config
        for attr in attrs:
            value = getattr(value, attr)
        return value

    getter.__doc__ = f"The config's ``{path}``."
    return getter


class EngineSettings:
    """Mixed into ``DeepSpeedEngine``: reads its ``_config``, ``zero`` and ``loss_scaler``."""

    _config: Any
    zero: Any
    loss_scaler: Any
    optimizer: Any
    basic_optimizer: Any
    grid: Any
    seq_parallel_group: Any
    precision: Any

    # ----- config values under DeepSpeed's getter names ----------------------------------------
    gradient_clipping = _reads("gradient_clipping")
    steps_per_print = _reads("steps_per_print")
    wall_clock_breakdown = _reads("wall_clock_breakdown")
    dataloader_drop_last = _reads("dataloader_drop_last")
    log_level = _reads("log_level")
    gradient_predivide_factor = _reads("gradient_predivide_factor")
    zero_allow_untested_optimizer = _reads("zero_allow_untested_optimizer")
    use_node_local_storage = _reads("checkpoint.use_node_local_storage")
    load_universal_checkpoint = _reads("checkpoint.load_universal")
    zero_reduce_scatter = _reads("zero_optimization.reduce_scatter")
    zero_overlap_comm = _reads("zero_optimization.overlap_comm")
    zero_sub_group_size = _reads("zero_optimization.sub_group_size")
    zero_reduce_bucket_size = _reads("zero_optimization.reduce_bucket_size")
    zero_multi_rank_bucket_allreduce = _reads("zero_optimization.use_multi_rank_bucket_allreduce")
    zero_allgather_bucket_size = _reads("zero_optimization.allgather_bucket_size")
    zero_contiguous_gradients = _reads("zero_optimization.contiguous_gradients")
    zero_load_from_fp32_weights = _reads("zero_optimization.load_from_fp32_weights")
    zero_elastic_checkpoint = _reads("zero_optimization.elastic_checkpoint")
    zero_max_live_parameters = _reads("zero_optimization.stage3_max_live_parameters")
    zero_max_reuse_distance = _reads("zero_optimization.stage3_max_reuse_distance")
    zero_prefetch_bucket_size = _reads("zero_optimization.stage3_prefetch_bucket_size")
    zero_param_persistence_threshold = _reads("zero_optimization.stage3_param_persistence_threshold")
    zero_ignore_unused_parameters = _reads("zero_optimization.ignore_unused_parameters")
    zero_allgather_partitions = _reads("zero_optimization.allgather_partitions")
    zero_round_robin_gradients = _reads("zero_optimization.round_robin_gradients")
    zero_hpz_partition_size = _reads("zero_optimization.zero_hpz_partition_size")
    zero_quantized_weights = _reads("zero_optimization.zero_quantized_weights")
    zero_quantized_gradients = _reads("zero_optimization.zero_quantized_gradients")
    flops_profiler_recompute_fwd_factor = _reads("flops_profiler.recompute_fwd_factor")
    flops_profiler_module_depth = _reads("flops_profiler.module_depth")
    flops_profiler_top_modules = _reads("flops_profiler.top_modules")
    flops_profiler_output_file = _reads("flops_profiler.output_file")
    autotuning_enabled = _reads("autotuning.enabled")
    autotuning_start_profile_step = _reads("autotuning.start_profile_step")
    autotuning_end_profile_step = _reads("autotuning.end_profile_step")
    autotuning_metric = _reads("autotuning.metric")
    tensor_parallel_config = _reads("tensor_parallel")
    aio_config = _reads("aio")

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def memory_breakdown(self) -> bool:
        return False  # the key is refused unless false

    def dump_state(self) -> bool:
        return False  # the key is refused unless false

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "Fail"

    def flops_profiler_enabled(self) -> bool:
        """On for the profiled step, and always inside an autotuning experiment (DeepSpeed's rule)."""
        return self._config.flops_profiler.enabled or self.autotuning_enabled()

    def flops_profiler_profile_step(self) -> int:
        """The profiled step: the experiment's first profiled step under autotuning."""
        if self.autotuning_enabled():
            return self.autotuning_start_profile_step()
        return self._config.flops_profiler.profile_step

    def flops_profiler_detailed(self) -> bool:
        return self._config.flops_profiler.detailed and not self.autotuning_enabled()

    def autotuning_metric_path(self) -> str:
        return self._config.autotuning.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        return self._config.autotuning.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")

    def autotuning_profile_model_info(self) -> bool:
        info = self._config.autotuning.model_info
        return bool(self.autotuning_enabled() and info and info.get("profile", False))

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's ``optimizer.type`` as written
        (DeepSpeed's own optimizer types lower-cased, as DeepSpeed's)."""
        given = self._config.raw.get("optimizer") or {}
        if "type" not in given:
            return type(self.basic_optimizer).__name__ if self.basic_optimizer is not None else None
        name = given["type"]
        return name.lower() if isinstance(name, str) and name.lower() in _LOWERED_OPTIMIZERS else name

    def optimizer_params(self) -> dict | None:
        """``optimizer.params`` as written (None without a config optimizer), as DeepSpeed's."""
        return _section_params(self._config.raw, "optimizer")

    def optimizer_legacy_fusion(self) -> bool:
        return False  # the key is refused unless false

    def scheduler_name(self) -> str | None:
        return (self._config.raw.get("scheduler") or {}).get("type")

    def scheduler_params(self) -> dict | None:
        return _section_params(self._config.raw, "scheduler")

    def get_mom(self) -> list[Any]:
        """Each param group's momentum (SGD, RMSprop) or betas, 0.0 where a group has none (DeepSpeed's)."""
        return self._group_values("momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas")

    def get_type(self) -> list[Any]:
        """Each param group's ``type`` entry, 0.0 where it has none (DeepSpeed's)."""
        return self._group_values("type")

    def _group_values(self, key: str) -> list[Any]:
        return [g.get(key, 0.0) for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def is_first_weights_partition_group(self) -> bool:
        return self.zero_optimization_partition_weights()

    def zero_offload_optimizer(self) -> Any:
        """The ``offload_optimizer`` section, None when it offloads nothing (DeepSpeed's None when absent)."""
        section = self._config.zero_optimization.offload_optimizer
        return section if section.device != "none" else None

    def zero_offload_param(self) -> Any:
        section = self._config.zero_optimization.offload_param
        return section if section.device != "none" else None

    def zero_use_cpu_optimizer(self) -> bool:
        return self._config.zero_optimization.offload_optimizer.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        return self._config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        return self._config.zero_optimization.offload_optimizer.device == "nvme"

    def zero_partial_offload(self) -> float:
        return self._config.zero_optimization.offload_optimizer.ratio

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return 2 ** self._config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic scaler's settings under DeepSpeed's loss-scaler keyword names."""
        fp16 = self._config.fp16
        return {"init_scale": self.initial_dynamic_scale(),
                **{key: getattr(fp16, attr) for key, attr in _SCALER_ARGS.items()}}

    @property
    def communication_data_type(self) -> torch.dtype:
        """The gradients' communication dtype: the config's, else the model's 16-bit dtype, else fp32."""
        return self.precision.comm_dtype or self.precision.model_dtype

    def get_data_parallel_rank(self) -> int:
        return self.grid.get_data_parallel_rank()

    def get_model_parallel_rank(self) -> int:
        return self.grid.get_model_parallel_rank()

    def get_tensor_parallel_rank(self) -> int:
        rank = getattr(self.grid, "get_tensor_model_parallel_rank", self.grid.get_model_parallel_rank)
        return rank()

    def get_sequence_parallel_group(self) -> Any:
        return self.seq_parallel_group

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    # ----- DeepSpeed's other getters --------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.zero.stage

    def autotp_size(self) -> int:
        """``tensor_parallel.autotp_size`` (after ``tp_model_init``'s, 0 without AutoTP), as DeepSpeed's."""
        return self._config.tensor_parallel.autotp_size

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def fp16_auto_cast(self) -> bool:
        return self._config.fp16.auto_cast

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, dtype gradients are summed in over an accumulation window), as DeepSpeed's."""
        return self.precision.data_types()

    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def curriculum_enabled_legacy(self) -> bool:
        return self._config.curriculum_learning.enabled

    def curriculum_params_legacy(self) -> dict | bool:
        """The ``curriculum_learning`` block as given, less ``enabled`` (False without one), as DeepSpeed's."""
        return _block_params(self._config.raw, "curriculum_learning")

    def data_efficiency_enabled(self) -> bool:
        return self._config.data_efficiency.enabled

    def data_efficiency_config(self) -> dict:
        """The ``data_efficiency`` block as given (``{}`` without one)."""
        return dict(self._config.raw.get("data_efficiency") or {})

    def data_sampling_enabled(self) -> bool:
        return self._config.data_efficiency.data_sampling.enabled

    def curriculum_learning_enabled(self) -> bool:
        """Whether ``deepspeed_io`` samples by curriculum (``data_sampling.curriculum_learning.enabled``)."""
        return self._config.data_efficiency.curriculum_enabled

    def random_ltd_enabled(self) -> bool:
        return self._config.data_efficiency.random_ltd_enabled

    def random_ltd_config(self) -> dict:
        """The ``random_ltd`` block as DeepSpeed's engine holds it (with the batch sizes)."""
        block = self._config.data_efficiency.data_routing.random_ltd
        return block.as_dict(self._config.train_micro_batch_size_per_gpu, self._config.train_batch_size)

    def random_ltd_initialize(self) -> None:
        """Join the model's ``RandomLayerTokenDrop`` layers to the engine's random-LTD schedule (what
        ``convert_to_random_ltd`` calls).

        Raises:
            ConfigError: random-LTD is off, or the wrapped layers do not match ``random_ltd_layer_id``.
        """
        from dslaunch.runtime.data_pipeline.data_routing.wiring import initialize_layers

        initialize_layers(self.module, self._config, self.random_ltd_scheduler)

    def set_data_post_process_func(self, post_process_func: Callable[[Any, dict], Any]) -> None:
        """``fn(batch, sampler_state)`` applied to each batch of the curriculum loader
        (``engine.training_dataloader``), as DeepSpeed's; other loaders ignore it, as DeepSpeed's."""
        if self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Callable[[int], int]]) -> None:
        """The ``custom`` schedules' functions of the curriculum sampler, metric name -> (step -> difficulty)."""
        if self.training_dataloader is not None and self.curriculum_learning_enabled():
            self.training_dataloader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """The forwards' autocast dtype (None when ``torch_autocast`` is off, as DeepSpeed's)."""
        autocast = self._config.torch_autocast
        return getattr(torch, autocast.dtype) if autocast.enabled else None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        names = self._config.torch_autocast.lower_precision_safe_modules
        return get_default_autocast_lower_precision_modules() if names is None else list(names)

    def pld_enabled(self) -> bool:
        return self._config.progressive_layer_drop.enabled

    def pld_params(self) -> dict | bool:
        """The ``progressive_layer_drop`` block as given, less ``enabled`` (False without one), as DeepSpeed's."""
        return _block_params(self._config.raw, "progressive_layer_drop")

    def pld_theta(self) -> float:
        return self._config.progressive_layer_drop.theta

    def pld_gamma(self) -> float:
        return self._config.progressive_layer_drop.gamma

    def get_pld_theta(self) -> float | None:
        """The keep probability now (None without progressive layer drop)."""
        pld = getattr(self, "progressive_layer_drop", None)
        return pld.get_theta() if pld is not None else None


def _block_params(raw: Any, key: str) -> dict | bool:
    block = raw.get(key)
    return {k: v for k, v in block.items() if k != "enabled"} if block is not None else False


def _section_params(raw: Any, key: str) -> dict | None:
    section = raw.get(key) or {}
    return section.get("params") if "type" in section else None
