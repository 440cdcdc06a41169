"""DeepSpeed 0.19.8's ds_config defaults, key path -> value, as read from the real DeepSpeed.

Read from ``deepspeed.runtime.config.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2})`` of
DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``, a separate venv): its ``zero_config``,
``float16_config``/``bfloat16_config``, ``aio_config``, ``checkpoint_config``, ``monitor_config``,
``pipeline``, ``flops_profiler_config`` and ``activation_checkpointing_config``, and the offload
configs' classes. Data only, torch-free: ``tests/runtime/config/test_defaults.py`` checks dslaunch's
defaults against it and the docs' config reference (``scripts/docs/reference.py``) prints it beside
dslaunch's.
"""

from __future__ import annotations

__all__ = ["DEEPSPEED_0_19_8", "get_scalar_param"]

DEEPSPEED_0_19_8: dict[str, object] = {
    "gradient_accumulation_steps": 1, "steps_per_print": None, "wall_clock_breakdown": False,
    "gradient_clipping": 1.0, "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    "communication_data_type": None, "zero_allow_untested_optimizer": False, "dataloader_drop_last": False,
    "log_level": None, "managed_gradient_accumulation": True,
    "zero_optimization.stage": 0, "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.allgather_bucket_size": 500_000_000, "zero_optimization.overlap_comm": False,
    "zero_optimization.contiguous_gradients": True, "zero_optimization.reduce_scatter": True,
    "zero_optimization.allgather_partitions": True, "zero_optimization.use_multi_rank_bucket_allreduce": True,
    "zero_optimization.round_robin_gradients": False, "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.ignore_unused_parameters": True, "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.offload_optimizer.device": "none", "zero_optimization.offload_optimizer.pin_memory": True,
    "zero_optimization.offload_optimizer.buffer_count": 4, "zero_optimization.offload_optimizer.ratio": 1.0,
    "zero_optimization.offload_optimizer.pipeline_read": False,
    "zero_optimization.offload_optimizer.pipeline_write": False,
    "zero_optimization.offload_param.device": "none", "zero_optimization.offload_param.pin_memory": True,
    "zero_optimization.offload_param.buffer_count": 5, "zero_optimization.offload_param.buffer_size": 100_000_000,
    "zero_optimization.offload_param.max_in_cpu": 1_000_000_000,
    "fp16.enabled": False, "fp16.loss_scale": 0.0, "fp16.initial_scale_power": 16, "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2, "fp16.consecutive_hysteresis": False, "fp16.min_loss_scale": 1,
    "bf16.enabled": False, "bf16.check_grad_overflow": True, "bf16.immediate_grad_update": False,
    "data_types.grad_accum_dtype": None,
    "aio.block_size": 1_048_576, "aio.queue_depth": 8,
    "checkpoint.tag_validation": "Warn", "checkpoint.use_node_local_storage": False,
    "pipeline.stages": "auto", "pipeline.activation_checkpoint_interval": 0,
    "activation_checkpointing.partition_activations": False,
    "activation_checkpointing.contiguous_memory_optimization": False,
    "activation_checkpointing.cpu_checkpointing": False, "activation_checkpointing.number_checkpoints": None,
    "activation_checkpointing.synchronize_checkpoint_boundary": False, "activation_checkpointing.profile": False,
    "flops_profiler.enabled": False, "flops_profiler.profile_step": 1, "flops_profiler.module_depth": -1,
    "flops_profiler.top_modules": 1, "flops_profiler.detailed": True, "flops_profiler.output_file": None,
    "flops_profiler.recompute_fwd_factor": 0.0,
    "tensorboard.enabled": False, "tensorboard.output_path": "", "tensorboard.job_name": "DeepSpeedJobName",
    "csv_monitor.enabled": False, "csv_monitor.job_name": "DeepSpeedJobName",
    "wandb.enabled": False, "wandb.project": "deepspeed", "comet.enabled": False, "comet.samples_log_interval": 100,
    "comms_logger.enabled": False, "comms_logger.verbose": False, "comms_logger.prof_all": True,
    "comms_logger.debug": False,
    # parse_autoep_config's defaults (deepspeed/module_inject/auto_ep_config.py of 0.19.8)
    "expert_parallel.enabled": False, "expert_parallel.autoep_size": 1, "expert_parallel.preset_model": None,
    "expert_parallel.use_grouped_mm": True, "expert_parallel.route_norm": None, "expert_parallel.route_scale": 1.0,
    "expert_parallel.score_func": "auto", "expert_parallel.top_k": "auto", "expert_parallel.routed_scaling_factor": "auto",
    "expert_parallel.num_expert_groups": None, "expert_parallel.moe_layer_pattern": None,
}


def get_scalar_param(param_dict: dict, key: str) -> object:
    """A top-level key's value as written, else DeepSpeed 0.19.8's default: what DeepSpeed's
    ``deepspeed.runtime.config.get_<key>(param_dict)`` functions return (no validation)."""
    return param_dict.get(key, DEEPSPEED_0_19_8[key])
