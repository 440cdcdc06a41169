"""The fake-quantizers and the top-k mask of DeepSpeed Compression (``deepspeed.compression.utils``).

Each is an autograd function with a straight-through backward (the gradient passes unchanged):
``SymQuantizer`` / ``AsymQuantizer`` round to ``2**bits`` levels per group (a group is a row of
the tensor reshaped to ``(num_groups, -1)``), or, for static activation ranges, within a given
``[min, max]``; ``TernaryQuantizer`` (2 bits) and ``BinaryQuantizer`` (1 bit) are the XTC
extreme cases; ``TopKBinarizer`` keeps the top ``ratio`` of scores as a 0/1 mask. ``QuantAct`` is
the static activation quantizer, whose range is a running (momentum) min/max of training batches.
The arithmetic follows DeepSpeed 0.19.6 step for step, so results match it bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["TopKBinarizer", "SymQuantizer", "AsymQuantizer", "TernaryQuantizer", "BinaryQuantizer", "QuantAct",
           "weight_quantizer"]


class TopKBinarizer(torch.autograd.Function):
    """``mask = 1`` where a score is among the top ``ceil(ratio * numel)``, else 0 (same shape).

    ``sigmoid=True`` takes ``ratio`` as a learnable logit (its gradient is the masked sum)."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, threshold: Any, sigmoid: bool) -> torch.Tensor:
        if sigmoid:
            threshold = torch.sigmoid(threshold).item()
        ctx.sigmoid = sigmoid
        order = inputs.flatten().sort(descending=True).indices
        keep = math.ceil(threshold * inputs.numel())
        flat = torch.zeros(inputs.numel(), dtype=inputs.dtype, device=inputs.device)
        flat[order[:keep]] = 1.0
        mask = flat.view_as(inputs)
        ctx.save_for_backward(mask)
        return mask

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = ctx.saved_tensors
        if ctx.sigmoid:
            return grad.clone(), (grad * mask).sum().view(-1), None
        return grad.clone(), None, None


class _StraightThrough(torch.autograd.Function):
    """A quantizer's backward: the gradient passes as if the rounding were the identity."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad.clone(), None, None, None, None


class SymQuantizer(_StraightThrough):
    """Symmetric: ``round(x / s)`` clamped to ``[-2**(b-1), 2**(b-1) - 1]``, times ``s = 2 max|x| / 2**b``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, num_bits: int, min_value: Any = None, max_value: Any = None,
                num_groups: int = 1) -> torch.Tensor:
        levels = 2**num_bits
        shape = x.shape
        if min_value is None:
            x = x.reshape(num_groups, -1)
            peak = torch.amax(torch.abs(x), dim=-1).view(num_groups, -1)
        else:  # a static range: one group
            peak = torch.max(min_value.abs(), max_value).view(-1)
        scale = 2 * peak / levels
        out = (x / scale).round().clamp(-levels // 2, levels // 2 - 1) * scale
        return out.reshape(shape).contiguous()


class AsymQuantizer(_StraightThrough):
    """Asymmetric: ``2**b`` levels between min and max, a zero point rounded to the grid."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, num_bits: int, min_value: Any = None, max_value: Any = None,
                num_groups: int = 1) -> torch.Tensor:
        levels = 2**num_bits
        shape = x.shape
        if min_value is None:
            x = x.reshape(num_groups, -1)
            min_value = x.amin(dim=-1, keepdim=True)
            max_value = x.amax(dim=-1, keepdim=True)
        scale = (max_value - min_value) / levels
        zero = (min_value / scale).round() * scale
        out = ((x - zero) / scale).round().clamp(0, levels - 1) * scale + zero
        return out.reshape(shape).contiguous()


class TernaryQuantizer(_StraightThrough):
    """{-a, 0, +a} per group: 0 below ``0.7 * mean|x|``, ``a`` = mean |x| of the kept values."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, num_bits: int, min_value: Any = None, max_value: Any = None,
                num_groups: int = 1) -> torch.Tensor:
        flat = x.reshape(num_groups, -1)
        threshold = (0.7 * flat.norm(p=1, dim=1).div(flat.shape[1])).view(-1, 1)
        pos = (flat > threshold).type(x.type())
        neg = (flat < -threshold).type(x.type())
        kept = (flat.abs() > threshold).type(x.type())
        alpha = ((kept * flat).abs().sum(dim=1) / kept.sum(dim=1)).view(-1, 1)
        return (alpha * pos - alpha * neg).reshape(x.shape).contiguous()


class BinaryQuantizer(_StraightThrough):
    """{-m, +m} per group: the sign times the group's mean |x|."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, num_bits: int, min_value: Any = None, max_value: Any = None,
                num_groups: int = 1) -> torch.Tensor:
        flat = x.reshape(num_groups, -1)
        mean = flat.norm(p=1, dim=1, keepdim=True).div(flat.shape[1])
        return flat.sign().mul(mean).reshape(x.shape).contiguous()


class QuantAct(nn.Module):
    """Static activation quantization: the range (buffer ``x_min_max``) follows training batches'
    min/max with momentum ``act_range_momentum`` and is frozen in eval."""

    def __init__(self, act_range_momentum: float = 0.95, quant_mode: str = "symmetric"):
        super().__init__()
        self.act_range_momentum = act_range_momentum
        self.quant_mode = quant_mode
        self.act_function = SymQuantizer.apply if quant_mode == "symmetric" else AsymQuantizer.apply
        self.register_buffer("x_min_max", torch.zeros(2))

    def forward(self, x: torch.Tensor, num_bits: int, *unused: Any) -> torch.Tensor:
        if self.training:
            low, high = x.data.min(), x.data.max()
            if self.x_min_max[0] == self.x_min_max[1]:  # first batch: start from its range
                self.x_min_max[0], self.x_min_max[1] = low, high
            m = self.act_range_momentum
            self.x_min_max[0] = self.x_min_max[0] * m + low * (1 - m)
            self.x_min_max[1] = self.x_min_max[1] * m + high * (1 - m)
        return self.act_function(x, num_bits, self.x_min_max[0], self.x_min_max[1])


def weight_quantizer(target_bits: int, quantization_type: str) -> Any:
    """The fake-quantizer DeepSpeed picks for weights at ``target_bits``.

    Raises:
        ConfigError: ternary or binary (2 or 1 bits) with asymmetric quantization.
    """
    if target_bits >= 3:
        return SymQuantizer.apply if quantization_type == "symmetric" else AsymQuantizer.apply
    if quantization_type != "symmetric":
        from dslaunch.errors import ConfigError

        raise ConfigError(f"{target_bits}-bit weights ({'ternary' if target_bits == 2 else 'binary'}) are "
                          "symmetric only; set quantization_type to symmetric",
                          key="compression_training.weight_quantization.shared_parameters.quantization_type")
    return TernaryQuantizer.apply if target_bits == 2 else BinaryQuantizer.apply
