"""The DeepSpeed unit-test files run for conformance, by the dslaunch area they exercise.

Paths are relative to DeepSpeed's ``tests/`` folder. Only areas dslaunch implements are listed;
files that need a GPU, an op build or a model download are left out (they skip or fail on both
sides alike and would only slow the run).
"""

from __future__ import annotations

AREAS: dict[str, list[str]] = {
    "pipe": [
        "unit/runtime/pipe/test_pipe.py",
        "unit/runtime/pipe/test_pipe_schedule.py",
        "unit/pipe/test_pipe_module.py",
    ],
    "topology": ["unit/runtime/pipe/test_topology.py"],
    "activation checkpointing": [
        "unit/runtime/activation_checkpointing/test_activation_checkpointing.py",
        "unit/runtime/activation_checkpointing/test_activation_checkpointing_non_reentrant.py",
    ],
    "flops profiler": ["unit/profiling/flops_profiler/test_flops_profiler.py"],
    "monitor": ["unit/monitor/test_monitor.py"],
    "comm": [
        "unit/comm/test_dist.py",
        "unit/comm/test_comms_logger.py",
        "unit/runtime/comm/test_coalesced_collectives.py",
    ],
    "elasticity": ["unit/elasticity/test_elastic.py"],
    "launcher": [
        "unit/launcher/test_ds_arguments.py",
        "unit/launcher/test_multinode_runner.py",
        "unit/launcher/test_run.py",
        "unit/launcher/test_user_args.py",
    ],
    "checkpoint": [
        "unit/checkpoint/test_latest_checkpoint.py",
        "unit/checkpoint/test_tag_validation.py",
        "unit/checkpoint/test_lr_scheduler.py",
        "unit/checkpoint/test_other_optimizer.py",
        "unit/checkpoint/test_zero_optimizer.py",
        "unit/checkpoint/test_shared_weights.py",
        "unit/checkpoint/test_pipeline.py",
    ],
    "runtime config/initialize": [
        "unit/runtime/test_ds_config_dict.py",
        "unit/runtime/test_ds_config_model.py",
        "unit/runtime/test_ds_initialize.py",
    ],
    "lr schedulers": ["unit/runtime/test_lr_schedulers.py"],
    "zero config/context": [
        "unit/runtime/zero/test_zero_config.py",
        "unit/runtime/zero/test_zero_context.py",
        "unit/runtime/zero/test_zero_tiled.py",
        "unit/runtime/zero/test_zero_tensor_fragment.py",
    ],
    "sequence parallel (ALST tiling)": ["unit/ulysses_alst/test_tiled_compute.py"],
    "inference config": [
        "unit/inference/test_inference_config.py",
        "unit/inference/test_checkpoint_sharding.py",
    ],
}


def all_files() -> list[str]:
    return [path for files in AREAS.values() for path in files]
