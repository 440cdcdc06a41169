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
    # Left out: test_zero_autocast_mixed_dtype.py (its one test skips on CPU: it needs a bf16 accelerator),
    # test_nvme_checkpointing.py (every test is marked sequential, deselected by DeepSpeed's pytest.ini,
    # and needs the async_io op build).
    "zero engine (stage 3 hooks, leaf modules, ZeRO++, clipping)": [
        "unit/runtime/zero/test_ignore_unused_parameters.py",
        "unit/runtime/zero/test_unwrap_model.py",
        "unit/runtime/zero/test_zero_allreduce_fetch_params.py",
        "unit/runtime/zero/test_zero_context_ancestry.py",
        "unit/runtime/zero/test_zero_context_return.py",
        "unit/runtime/zero/test_zero_dynamic_class.py",
        "unit/runtime/zero/test_zero_grad_clip.py",
        "unit/runtime/zero/test_zero_hook_attribute_delegation.py",
        "unit/runtime/zero/test_zero_late_module_attach.py",
        "unit/runtime/zero/test_zero_leaf_module.py",
        "unit/runtime/zero/test_zero_linear_direct_init.py",
        "unit/runtime/zero/test_zero_nesting_init.py",
        "unit/runtime/zero/test_zero_offloadpp.py",
        "unit/runtime/zero/test_zeropp.py",
    ],
    # Left out: test_mics_optimizer.py (skips at module level on torch > 2.0, both sides; MiCS is not in
    # dslaunch: zero_optimization.mics_shard_size is refused).
    "checkpoint (MoE, universal, conversion, reshape)": [
        "unit/checkpoint/test_moe_checkpoint.py",
        "unit/checkpoint/test_universal_checkpoint.py",
        "unit/checkpoint/test_convert_checkpoint.py",
        "unit/checkpoint/test_reshape_checkpoint.py",
        "unit/checkpoint/test_autotp_uc_checkpoint.py",
        "unit/checkpoint/test_sparse.py",
    ],
    "sequence parallel (ALST tiling)": ["unit/ulysses_alst/test_tiled_compute.py"],
    # AutoSP: both files run on CPU with gloo (2 ranks), mock attention and nn.Identity projectors.
    "sequence parallel (AutoSP, multimodal)": [
        "unit/sequence_parallelism/test_autosp_equivalence.py",
        "unit/sequence_parallelism/test_autosp_integration.py",
    ],
    "inference config": [
        "unit/inference/test_inference_config.py",
        "unit/inference/test_checkpoint_sharding.py",
    ],
    # Left out: test_pld.py (0.19.8 has no deepspeed.runtime.progressive_layer_drop: it fails to
    # import on both sides) and test_mup_optimizers.py (needs the ``mup`` package, in neither venv).
    "engine runtime (no_sync, multiple models, autocast)": [
        "unit/runtime/test_no_sync_ctxt.py",
        "unit/runtime/test_multiple_models.py",
        "unit/runtime/test_multi_output_model.py",
        "unit/runtime/test_autocast.py",
        "unit/runtime/test_data.py",
        "unit/runtime/test_runtime_utils.py",
    ],
    # Left out: onebit/test_onebit.py (0.19.8 has no deepspeed.runtime.fp16.onebit: it fails to
    # import on both sides; dslaunch's 1-bit optimizers are tested in tests/runtime/optim).
    "half precision and 1-bit": [
        "unit/runtime/test_precision_config_loss_scale.py",
        "unit/runtime/test_precision_config_dynamic_scale.py",
        "unit/runtime/half_precision/test_dynamic_loss_scale.py",
        "unit/runtime/half_precision/test_fp16.py",
        "unit/runtime/half_precision/test_zero_optim_overflow.py",
    ],
    "optimizers (CPU Adam, Adagrad, Lion)": [
        "unit/ops/adam/test_cpu_adam.py",
        "unit/ops/adam/test_adamw.py",
        "unit/ops/adam/test_hybrid_adam.py",
        "unit/ops/adagrad/test_cpu_adagrad.py",
        "unit/ops/lion/test_cpu_lion.py",
        "unit/ops/lion/test_lion.py",
    ],
    # Left out: unit/ulysses_alst/test_ulysses_sp_hf.py (every test loads
    # hf-internal-testing/tiny-random-LlamaForCausalLM from the Hub: no network here),
    # unit/sequence_parallelism/test_ulysses.py (its tests load bert-base-uncased from the Hub, need
    # flash_attn on a GPU (FPDT: TestFPDTAttention skips without flash_attn before it touches
    # deepspeed, though dslaunch's FPDT needs none; tests/runtime/sequence_parallel/test_fpdt.py makes
    # its call instead), or call DeepSpeed's private _SeqAllToAll; both need transformers, which only
    # the DeepSpeed venv has) and test_autotp_custom_patterns.py (it imports
    # tp_shard.set_num_kv_heads, which 0.19.8 lacks: it fails to import on both sides).
    "sequence and tensor parallel training": [
        "unit/model_parallelism/test_autotp_training.py",
    ],
    # Wave 3: DeepSpeed's tests/unit/v1 (its newer engine tests). test_zero.py (99) and
    # test_zero_user_backward.py (192) run about 30 min a side here under load (run.py's LONG_FILES
    # gives them 6 file caps; HARNESS_STOPPERS are deselected on dslaunch's side); most of
    # test_zero_user_backward.py's comparisons build DistributedDataParallel(device_ids=[rank]),
    # which fails on CPU on both sides. Left out for now: test_zero_activation_checkpoint_lifecycle.py
    # (it asserts DeepSpeed's F.linear patch and reads its parameters' ds_active_sub_modules and
    # ds_param_alias: internals; DeepSpeed's side not run), test_offload_states.py (every test
    # asserts get_accelerator().memory_allocated() drops after offload_states: on the CPU accelerator
    # that is the process RSS, which a move to host memory cannot lower; DeepSpeed failed its first
    # 15 of 128 there, 14 at that assertion, ~80 s each; dslaunch's offload_states is tested in
    # tests/runtime/zero/test_offload_states.py and on a GPU in tests/gpu/), the GPU/op-build
    # files (v1/nvme, v1/ops, v1/compile, v1/pin_memory), and
    # runtime/sparse_tensor's two files (their config sets
    # sparse_gradients, which 0.19.8 refuses: both sides fail at initialize).
    "zero and precision, DeepSpeed's newer tests (v1)": [
        "unit/v1/zero/test_zero.py",
        "unit/v1/zero/test_zero_cpu_offload_grad_accum.py",
        "unit/v1/zero/test_zero2_offload_multi_backward.py",
        "unit/v1/zero/test_zero_coalesce_grad_reduction.py",
        "unit/v1/zero/test_zero_user_backward.py",
        "unit/v1/zero/test_zero_functorch_linear.py",
        "unit/v1/half_precision/test_bf16.py",
        "unit/v1/half_precision/test_gradient_clipping_default.py",
        "unit/v1/half_precision/test_mixed_precision_dtype.py",
        "unit/v1/test_engine_log_level.py",
    ],
    # v1/moe: DeepSpeed's MoE layer and AutoEP tests, all on CPU with gloo. Nine of them
    # (test_autoep_autotp_*) test AutoEP with AutoTP ("folding"), which dslaunch trains (most of
    # their losses read DeepSpeed's parameter names, files or private hooks); most of the rest call DeepSpeed's AutoEP
    # internals (its GroupedExperts, TokenChoiceTopKRouter, ep_repack, the universal-checkpoint
    # converter of its expert layout). They are run so the table shows it; EXPECTED_FAILURES.md says why.
    "MoE and AutoEP (v1/moe)": [
        "unit/v1/moe/test_moe.py",
        "unit/v1/moe/test_moe_tp.py",
        "unit/v1/moe/test_fused_expert_layout.py",
        "unit/v1/moe/test_autoep_integration.py",
        "unit/v1/moe/test_autoep_grad_parity.py",
        "unit/v1/moe/test_autoep_checkpoint.py",
        "unit/v1/moe/test_autoep_unit.py",
        "unit/v1/moe/test_autoep_autotp_bf16_folding_parity.py",
        "unit/v1/moe/test_autoep_autotp_checkpoint.py",
        "unit/v1/moe/test_autoep_autotp_deepcompile_reject.py",
        "unit/v1/moe/test_autoep_autotp_dispatch.py",
        "unit/v1/moe/test_autoep_autotp_folding_config.py",
        "unit/v1/moe/test_autoep_autotp_folding_groups.py",
        "unit/v1/moe/test_autoep_autotp_grad_parity.py",
        "unit/v1/moe/test_autoep_autotp_runtime.py",
        "unit/v1/moe/test_autoep_autotp_zero1_overlap_folding.py",
    ],
    "utils (groups, partition)": [
        "unit/runtime/utils/test_partition.py",
        "unit/utils/test_groups.py",
        "unit/utils/test_partition_balanced.py",
        "unit/utils/test_init_on_device.py",
        "unit/utils/test_get_optim_files.py",
    ],
    # DeepSpeed's tests here are 0.19.6's: four call HybridEngineRollout._sample_top_p, which 0.19.8
    # removed (it samples through the model's generate), and the graph-capture one hands generate a
    # MagicMock SamplingConfig whose continuous_batch_size is not None; they fail on both sides.
    "rollout (RL / on-policy distillation generation)": [
        "unit/runtime/rollout/test_rollout_interface.py",
        "unit/runtime/rollout/test_hybrid_engine_rollout.py",
    ],
    # DeepSpeed Compression: 0.19.8 removed the library, so DeepSpeed's own side fails this 0.19.6 file at
    # collection (no deepspeed.compression.compress); dslaunch keeps the library and passes its two CPU
    # tests (the Megatron mpu test skips itself on both sides). Left out: test_dequantization.py, which
    # loads the InferenceBuilder op (DeepSpeed fails it on CPU after a 4-minute build attempt; dslaunch skips).
    "compression": ["unit/compression/test_compression.py"],
}


def all_files() -> list[str]:
    return [path for files in AREAS.values() for path in files]
