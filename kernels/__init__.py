"""Kernels: ONE dispatch point, ``get(op, device)``, for every op a fused implementation may replace.

Modules: ``dispatch.py`` (the op table and ``get``), ``reference.py`` (every op's torch
reference), ``chunks.py`` (the cache-sized batches the references and optimizers step over),
``cpu/`` (C kernels), ``triton/`` (GPU kernels), ``block_sparse/`` (block-sparse matrices: the
``MatMul`` and ``Softmax`` of sparse attention, torch on any device), and the modules and optimizers built on the
ops that DeepSpeed's ``deepspeed.ops`` paths re-export: ``fused_adam.py`` (``FusedAdam``),
``normalization.py`` (``FusedLayerNorm``, ``FusedRMSNorm``), ``bias_gelu.py`` (``BiasGeLU``),
``transformer.py`` (``DeepSpeedTransformerLayer``, DeepSpeed's fused BERT layer) and
``transformer_config.py`` (its ``DeepSpeedTransformerConfig``). The lowest layer above ``dslaunch``'s base: nothing here
imports ``dslaunch.runtime`` or the launcher (``tests/test_layering.py``).

``get`` returns the fused implementation registered for the op and the device's type when it can
run here, else the reference (torch code). Adding one is a ``Kernel`` entry in
``dispatch.KERNELS.fused`` and nothing else. Registered: the C kernels of ``cpu/`` (built on first
use with the system's C compiler, see ``cpu/build.py``) for ``"adam"``, ``"cpu_adam"``, ``"lion"``,
``"adagrad"``, ``"torch.adam"``, ``"torch.adamw"``, ``"torch.adagrad"``, ``"onebit_pack"`` and
``"onebit_unpack"`` on CPU; ``"torch.sgd"`` has none. The Triton kernels of ``triton/`` (where
triton imports and CUDA is there) for ``"adam"``, ``"layer_norm"``, ``"rms_norm"``,
``"bias_gelu"``, ``"onebit_pack"``, ``"onebit_unpack"``, ``"cross_entropy"``, ``"block_sparse_sdd"`` and
``"block_sparse_spmm"`` on CUDA devices.
The environment variable ``DSLAUNCH_KERNELS`` overrides the choice: ``auto`` (default),
``reference`` (never fused) or ``fused`` (fail with ``UsageError`` where no fused kernel runs).

Ops, and the signature a fused implementation must have (all update tensors in place):

- ``"adam"``: ``(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, betas, eps, weight_decay,
  bias_correction, adam_w_mode, inv_scale, chunk_numel)``: one Adam/AdamW step of parameters
  that share the step count ``step`` (DeepSpeed FusedAdam semantics). Reference:
  ``reference.adam_update``, used by ``runtime.optim.adam.Adam`` and
  ``fused_adam.FusedAdam``. An implementation with ``handles_dtypes = True`` (the Triton one) takes
  bf16/fp16 lists and computes in fp32; FusedAdam gives the others fp32 copies.
- ``"cpu_adam"``: ``"adam"``'s signature, rounded as DeepSpeed's ``DeepSpeedCPUAdam`` (the
  second-moment correction a multiply, one division per element; ``"adam"`` rounds as torch's
  fused AdamW). Reference: ``reference.cpu_adam_update``, used by
  ``dslaunch.ops.adam.DeepSpeedCPUAdam``. No GPU kernel (the class is CPU-only).
- ``"lion"``: ``(params, grads, exp_avgs, *, lr, betas, weight_decay, inv_scale, chunk_numel)``.
  Reference: ``reference.lion_update``, used by ``runtime.optim.lion.Lion``.
- ``"adagrad"``: ``(params, grads, state_sums, *, clr, eps, weight_decay, inv_scale)``: one
  Adagrad step at the current learning rate ``clr``. Reference: ``reference.adagrad_update``, used
  by ``dslaunch.ops.adagrad.DeepSpeedCPUAdagrad``.
- ``"torch.adamw"``, ``"torch.adam"``, ``"torch.sgd"``, ``"torch.adagrad"``: ``(optimizer,
  closure) -> loss``: one step of that torch optimizer over its ``param_groups`` and ``state``
  (torch's layout), honouring torch's AMP protocol (``grad_scale``, ``found_inf``). Reference:
  torch's own step (``reference.torch_step``), used by ``runtime.optim.torch_optimizers``.

- ``"layer_norm"``: ``(x, weight, bias, eps=1e-5, normalized_shape=None) -> y``, differentiable:
  ``F.layer_norm`` over ``weight``'s shape (``normalized_shape`` when weight is None). Reference:
  ``reference.layer_norm``, used by ``normalization.py`` (``dslaunch.ops.normalization``).
- ``"rms_norm"``: ``(x, weight, eps=1e-6, normalized_shape=None) -> y``, as ``F.rms_norm``.
- ``"bias_gelu"``: ``(x, bias, approximate="none", p=0.0, training=True, seed=None) -> y``,
  differentiable: ``dropout(gelu(x + bias, approximate), p)``; ``seed`` fixes the dropout mask
  (which differs between implementations; only its law is shared). Used by ``bias_gelu.py`` (``dslaunch.ops.bias_gelu``).
- ``"onebit_pack"``: ``(x, error, rows, scale)``: the signs of ``x`` packed 8 to a byte into the
  uint8 ``rows`` (``scale`` as 4 fp32 bytes behind each row's signs); ``error = x - scale * sign(x)``.
  ``"onebit_unpack"``: ``(rows, out, mean)``: each row's signs times its scale into ``out``, or
  their mean over the rows. References: ``reference.pack_reference``/``unpack_reference``, used by
  ``runtime.optim.compression`` (the 1-bit optimizers' exchange).

- ``"cross_entropy"``: ``(logits, target, ignore_index=-100, block_rows=None) -> loss``,
  differentiable: ``F.cross_entropy(logits.float(), target, reduction="none")`` of contiguous
  ``[rows, vocab]`` logits (0 for ignored rows) without keeping an fp32 ``[rows, vocab]`` tensor;
  the gradient comes in the logits' dtype. Reference: ``reference.cross_entropy_rows`` (blocks of
  ``block_rows`` rows), used by ``runtime.chunked_cross_entropy``.

- ``"block_sparse_sdd"``: ``(a, b, lay) -> tiles``: the kept tiles ``[Z, nnz, bs, bs]`` of
  ``a @ b`` (``[Z, H, M, K]`` by ``[Z, H, K, N]``) for the ``block_sparse.BlockLayout`` ``lay``;
  ``"block_sparse_spmm"``: ``(s, transposed, d, lay) -> dense``: block-sparse ``s`` (or its
  transpose) times dense ``d``. Not differentiable (``block_sparse.matmul`` defines the
  gradients with them). References: ``block_sparse.format.sdd``/``spmm``, used by ``MatMul``.

``inv_scale`` is None or the factor gradients are multiplied by inside the update (the gradients
themselves stay as they are); ``chunk_numel`` is the reference's cache-sized batch, which a fused
kernel may ignore. Not dispatched: Lamb (its update spans a collective between two passes) and
torch optimizers picked by name outside the registered types.

Importing this package does not import torch.
"""

from dslaunch.kernels.dispatch import ENV, KERNELS, MODES, Kernel, KernelTable, get, mode

__all__ = ["get", "mode", "Kernel", "KernelTable", "KERNELS", "ENV", "MODES"]
