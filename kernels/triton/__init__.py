"""GPU kernels in Triton: multi-tensor Adam/AdamW, LayerNorm/RMSNorm, bias + GeLU (+ dropout),
1-bit compression, cross-entropy and block-sparse products.

- ``adam.py``: the ``"adam"`` dispatch op in one launch over many tensors (a table of pointers).
- ``norms.py``: LayerNorm and RMSNorm forward and backward (``"layer_norm"``/``"rms_norm"`` ops).
- ``bias_gelu.py``: bias + GeLU (erf or tanh) with optional seeded dropout, forward and backward
  (the ``"bias_gelu"`` op).
- ``onebit.py``: the 1-bit pack and unpack of the 1-bit optimizers (``"onebit_pack"``/``"onebit_unpack"``).
- ``cross_entropy.py``: per-row cross-entropy, forward and backward, without an fp32 copy of the
  logits (the ``"cross_entropy"`` op).
- ``block_sparse.py``: the block-sparse products of sparse attention (``"block_sparse_sdd"``,
  ``"block_sparse_spmm"``).

The dispatch point (``dslaunch.kernels.dispatch``) picks them on CUDA devices when ``available()``;
elsewhere the torch reference runs. Importing this package imports neither torch nor triton: the
kernel modules do, on first use. They also run on CPU tensors under ``TRITON_INTERPRET=1`` (the
interpreter, slow: the tests use it), but the dispatch point never picks them there.
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["available"]


@functools.cache
def available() -> bool:
    """Whether the Triton kernels can run here: triton imports and a CUDA device exists."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (e.g. no driver found) means the torch reference
        return False
    return True
