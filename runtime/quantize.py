"""``deepspeed.runtime.quantize``: the optimizer-step weight quantizer (MoQ, Mixture-of-Quantization).

With ``compression_training.weight_quantization`` enabled and ``quantize_weight_in_forward`` false,
the engine quantizes the fp16 weights of the groups' layers after each applied optimizer step (the
fp32 master weights stay exact). Each weight carries its schedule (``init_compression`` put it
there): it starts at ``start_bits`` and loses one bit each time the quantizer's step count reaches
its ``q_period``, which then doubles, until ``target_bits``. 3 bits or more round to a grid
(symmetric or asymmetric, nearest or stochastic rounding) per ``quantize_groups`` groups; 2 bits
are ternary, 1 bit binary. With ``fp16_mixed_quantize`` the weight is blended, from all fp16 to
all quantized by ``quantize_change_ratio`` per step, while it is within one bit of the target.

Limitations: no eigenvalue-scaled periods (DeepSpeed 0.19.8 removed the eigenvalue block) and no
CUDA quantizer kernel; stochastic rounding draws from each rank's own generator.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dslaunch.utils.logging import logger

__all__ = ["Quantizer", "TWO_D_PARAMS"]

TWO_D_PARAMS = 6  # DeepSpeed's count of 2-D weights per transformer layer (any_precision_switch)


class Quantizer:
    """Quantizes the scheduled weights of parameter groups in place (DeepSpeed's ``Quantizer``).

    Args:
        q_groups: groups per weight, each with its own range.
        q_mixed_fp16: blend fp16 and quantized weights near the target bits.
        q_change_ratio: how much the blend moves to the quantized weight per step.
        q_type: ``symmetric`` or ``asymmetric``.
        q_rounding: ``nearest`` or ``stochastic``.
        q_verbose: log each bit change.
        q_eigenvalue: eigenvalue-scaled periods (refused: DeepSpeed removed them).
        use_quantizer_kernel: DeepSpeed's CUDA kernel (refused).
        layer_num: layers for ``any_precision_switch``.

    Raises:
        NotImplementedError: ``q_eigenvalue`` or ``use_quantizer_kernel``.
    """

    def __init__(self, q_groups: int = 1, q_mixed_fp16: bool = False, q_change_ratio: float = 0.01,
                 q_type: str = "symmetric", q_rounding: str = "nearest", q_verbose: bool = False,
                 q_eigenvalue: bool = False, use_quantizer_kernel: bool = False, layer_num: int = 0):
        if q_eigenvalue or use_quantizer_kernel:
            raise NotImplementedError("eigenvalue-scaled quantization and the CUDA quantizer kernel are not in "
                                      "dslaunch; leave both off")
        self.q_groups, self.q_mixed_fp16, self.q_change_ratio = q_groups, q_mixed_fp16, q_change_ratio
        self.q_type, self.q_rounding, self.q_verbose = q_type, q_rounding, q_verbose
        self.q_eigenvalue, self.use_quantizer_kernel, self.layer_num = q_eigenvalue, use_quantizer_kernel, layer_num
        self.qsteps = 0
        self.quantize_real_ratio = 1.0

    def any_precision_switch(self) -> bool:
        """True (DeepSpeed's answer without eigenvalues)."""
        return True

    def quantize(self, parameter_group: Iterable[Iterable[torch.Tensor]], overflow: bool, eigenvalue_enabled: bool = False,
                 block_eigenvalue: Any = None) -> None:
        """One quantizer step over ``parameter_group`` (lists of parameters): nothing after an fp16
        overflow; else count the step, move the blend, and quantize each scheduled 2-D+ weight."""
        if overflow and not eigenvalue_enabled:
            return
        self.step()
        self.update_fp16_ratio()
        for group in parameter_group:
            for p in group:
                if p.dim() > 1 and getattr(p, "start_bits", None):
                    with torch.no_grad():
                        p.data.copy_(self.compute_quantization(p))  # in place: flat-buffer views stay views

    def step(self) -> None:
        self.qsteps += 1

    def quantize_highbit(self, inputs: torch.Tensor, num_bits: int) -> torch.Tensor:
        """Round to ``2**num_bits`` levels per group."""
        levels = 2**num_bits
        flat = inputs.reshape(self.q_groups, -1)
        low, high = flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
        noise: Any = 0.0 if self.q_rounding == "nearest" else flat.new(flat.shape).uniform_(-0.5, 0.5)
        if self.q_type == "symmetric":
            scale = 2 * torch.max(low.abs(), high.abs()) / levels
            flat = (flat / scale + noise).round().clamp(-(levels >> 1), (levels >> 1) - 1) * scale
        else:
            scale = (high - low) / levels
            zero = (low / scale).round() * scale
            flat = ((flat - zero) / scale + noise).round().clamp(0, levels - 1) * scale + zero
        return flat.reshape(inputs.shape).contiguous()

    def quantize_tenary(self, inputs: torch.Tensor) -> torch.Tensor:  # DeepSpeed's spelling
        """{-a, 0, +a} per group."""
        from dslaunch.runtime.compression.quantizers import TernaryQuantizer

        return TernaryQuantizer.apply(inputs, 2, None, None, self.q_groups)

    def quantize_binary(self, inputs: torch.Tensor) -> torch.Tensor:
        """{-m, +m} per group."""
        from dslaunch.runtime.compression.quantizers import BinaryQuantizer

        return BinaryQuantizer.apply(inputs, 1, None, None, self.q_groups)

    def compute_quantization(self, p: torch.Tensor, index: int = 0, factor: int = 1) -> torch.Tensor:
        """``p`` quantized at its current bits, after lowering them if its period is reached.

        Raises:
            ValueError: 1 or 2 bits with asymmetric quantization or stochastic rounding.
        """
        if p.start_bits != p.target_bits and self.qsteps >= p.q_period:
            self.quantize_real_ratio = 1.0
            p.q_period = (p.q_period << 1) * factor
            p.start_bits -= 1
            if self.q_verbose:
                logger.info(f"Quantization settings: current bit-precision = {p.start_bits}, step = {self.qsteps}, "
                            f"quantization period = {p.q_period}, index = {index}")
        bits = p.start_bits
        if bits >= 3:
            out = self.quantize_highbit(p.data, bits)
        elif self.q_type != "symmetric" or self.q_rounding != "nearest":
            raise ValueError(f"{bits}-bit weights need symmetric quantization with nearest rounding")
        else:
            out = self.quantize_tenary(p.data) if bits == 2 else self.quantize_binary(p.data)
        if self.q_mixed_fp16 and bits >= p.target_bits - 1:
            out = self.quantize_real_ratio * p.data + (1 - self.quantize_real_ratio) * out
        return out

    def update_fp16_ratio(self) -> None:
        """Move the fp16/quantized blend one ``q_change_ratio`` towards quantized."""
        if self.q_mixed_fp16:  # as DeepSpeed: the last decrement may go just below 0, then 0
            self.quantize_real_ratio = self.quantize_real_ratio - self.q_change_ratio if self.quantize_real_ratio > 0 \
                else 0.0
