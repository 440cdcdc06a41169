"""``deepspeed.ops.op_builder.builder``: the base class scripts subclass to JIT-build their own ops
(Megatron-DeepSpeed's fused kernels), and the torch version it checks. dslaunch builds no
DeepSpeed ops: a subclass imports and instantiates, and ``load()`` says so in one line."""

from __future__ import annotations

import torch

from dslaunch.ops.op_builder import OpBuilder

TORCH_MAJOR, TORCH_MINOR = (int(x) for x in torch.__version__.split(".")[:2])

__all__ = ["OpBuilder", "TORCH_MAJOR", "TORCH_MINOR"]
