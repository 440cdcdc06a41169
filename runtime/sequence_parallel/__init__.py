"""Ulysses sequence parallelism: the ranks of a sequence group each hold a part of every sample's
sequence and switch to a head split around attention.

- ``layout.py``: the differentiable all-to-all between the two layouts; key/value head replication.
- ``attention.py``: ``DistributedAttention`` (``deepspeed.sequence.layer``).
- ``batch.py``: one rank's shard of a batch (``shift_labels``, pad-and-mask, global positions).
- ``loss.py``: a shard's loss weighted over the whole sequence.
- ``cross_entropy.py``: DeepSpeed's ``deepspeed.sequence.cross_entropy`` (vocabulary-split and
  sequence-split cross-entropy, the causal-LM ``loss_function``) over ``tensor_parallel/loss.py``.
- ``linear_cross_entropy.py``: the cross-entropy of a vocabulary-parallel LM head fused with its
  projection, logits never made whole (``deepspeed.sequence.linear_cross_entropy``).
- ``vocab_parallel_ops.py``: log-probabilities, entropy and KL divergence of vocabulary-split logits,
  for RL and distillation losses (``deepspeed.sequence.vocab_parallel_ops``).
- ``tiling.py``: ALST's tiled computations (``TiledMLP``, ``TiledFusedLogitsLoss``,
  ``sequence_tiled_compute``): one slice of a long sequence's activations at a time.
- ``ulysses_sp.py``: ALST's Hugging Face integration (``UlyssesSPAttentionHF``,
  ``UlyssesSPDataLoaderAdapter``), DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp``.
- AutoSP (``deepspeed.sequence.auto_sp`` and its ``autosp_*`` modules), for vision towers and
  multimodal models: ``detector.py`` (which modules are vision/language attention and the
  projector), ``vit_attention.py`` (``UlyssesSPViTAttention``), ``fusion.py`` (the LLaVA, InternVL
  and Qwen2-VL fusion adapters), ``auto_wrap.py`` (``auto_wrap_model_for_sp``), over ``gather.py``
  (the sequence all-gather of shards of any length, its gradient summed over the ranks).
- FPDT (``deepspeed.sequence.fpdt_layer``), Ulysses with chunked attention for very long sequences:
  ``fpdt_input.py`` (the load-balanced token layout, ``FPDT_InputConstruct``), ``fpdt_blocks.py``
  (one query chunk against one key/value chunk, forward and backward, and the online-softmax merge),
  ``fpdt_attention.py`` (``FPDT_Attention``, chunks kept or offloaded to host memory) and
  ``fpdt_mlp.py`` (the chunked ``FPDT_FFN`` and ``FPDT_LogitsLoss``).

The sequence axis and its groups come from ``runtime/parallel`` (``sequence_parallel_size`` in
the config, or the mpu ``register_with_transformers`` returns); the engine averages gradients over
data x sequence (``parallel.mpu.gradient_reduce_group``).
"""
