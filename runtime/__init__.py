"""The training runtime: config, engines, ZeRO stages, precision, optimizers, checkpoints.

- entry points and engines: ``api.py`` (``initialize`` and DeepSpeed's other entry points),
  ``engine.py`` (``DeepSpeedEngine``), ``engine_setup.py`` (assembling its parts once),
  ``engine_checkpoint.py`` (its checkpoint methods), ``engine_settings.py`` (its getters of the
  settings), ``engine_accumulation.py`` (its accumulation clock: boundaries, ``no_sync``,
  ``allreduce_gradients``),
  ``plain_backward.py`` (a script's own ``loss.backward()``), ``hybrid_engine.py`` (the engine that
  also generates, DeepSpeed's ``DeepSpeedHybridEngine``), ``rollout/`` (RL rollouts through it), ``python_gc.py`` (``disable_python_gc``:
  the collector off while engines live), ``pipe/`` (the pipeline engine), ``inference/``
  (``init_inference``).
- what the engine delegates to: ``config/`` (the ds_config), ``zero/`` (the ZeRO strategies),
  ``precision/`` (dtypes and loss scaling), ``torch_autocast.py`` (forwards under
  ``torch.autocast``), ``progressive_layer_drop.py`` (the keep probability handed to forwards), ``compression/``
  (DeepSpeed Compression: compressing layers, their scheduler) and ``quantize.py`` (its
  optimizer-step weight quantizer, MoQ), ``optim/``, ``lr_schedules/``, ``checkpoint/``,
  ``dataloader.py``, ``activation_checkpointing/``, ``moe/``, ``tensor_parallel/``,
  ``sequence_parallel/``, ``sparse_attention/`` (block-sparse self-attention and its layouts),
  ``parallel/`` (topology and process groups), ``dist.py``
  (process-group setup), ``comm/`` (the collectives, DeepSpeed's ``deepspeed.comm``),
  ``accelerator.py`` (the device, DeepSpeed's ``get_accelerator``).
- watching a run: ``events.py`` (the engine's one seam for observers), ``observers.py`` (the
  built-in ones), ``heartbeat.py`` (beats to the launcher's monitor), ``preempt.py`` (checkpoint
  on request), ``shutdown.py`` (leaving cleanly at exit), ``timers.py``, ``throughput.py``,
  ``profiling/`` (the flops profiler, MFU), ``monitors/`` (TensorBoard, CSV, wandb, Comet),
  ``autotuning.py`` (one autotuning experiment).
- tools: ``estimate/`` (memory estimates), ``export_cli.py`` (``zero-to-fp32``'s command line),
  ``chunked_cross_entropy.py`` (a causal-LM loss without an fp32 copy of the logits),
  ``partitioned_tensor.py`` (a tensor split flat over a group, DeepSpeed's ``PartitionedTensor``),
  ``transformer_inject.py`` (DeepSpeed's fused BERT layer put into a model and taken out,
  ``replace_transformer_layer``) with ``transformer_policy.py`` (where a BERT layer keeps its weights),
  ``file_writers.py`` (DeepNVMe's file writers that ``torch.save`` writes into, ``deepspeed.io``).
- DeepSpeed's import paths answered from the above: ``utils.py``, ``constants.py``,
  ``config_utils.py``, ``precision_config.py``, ``keep_in_fp32.py``, ``base_optimizer.py`` (its
  wrappers' base classes), ``bf16_optimizer.py``, ``fp16/``,
  ``swap_tensor/``, ``data_pipeline/`` (its curriculum by step; the rest refused),
  ``checkpoint_engine/`` (its checkpoint-engine interface for a script's own files).
- ``domino/``: Domino, tensor-parallel layers whose all-reduces overlap the other micro batch's
  compute.

Submodules are attributes after a bare import (``dslaunch.runtime.lr_schedules``), imported on
first access, as DeepSpeed's ``deepspeed.runtime`` offers them.
"""

from dslaunch.utils.lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)
