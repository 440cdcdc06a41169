"""Block quantization for ZeRO++'s messages: symmetric int8 or int4, one fp32 scale per block.

A message of ``n`` values is cut into blocks of ``block`` values (the last one shorter); each
block is divided by its scale ``max|x| / qmax`` (qmax 127 for int8, 7 for int4) and rounded to the
nearest integer, so an element is off by at most half a step: ``|x - x'| <= scale / 2``. int4 holds
two values per byte (value + 8 in each nibble). DeepSpeed's kernels are symmetric too (int8 for
weights in groups of up to ~8k values, int4 for gradients).

A message travels as ONE uint8 buffer: the scales' bytes, then the packed values
(``packed_bytes``), so each piece costs one collective. Torch-only and CPU-friendly (a few passes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockQuant", "WEIGHTS", "GRADIENTS"]


@dataclass(frozen=True)
class BlockQuant:
    """A symmetric block quantizer: ``bits`` (8 or 4) per value, one fp32 scale per ``block``."""

    bits: int
    block: int

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def blocks(self, n: int) -> int:
        return -(-n // self.block)

    def packed_bytes(self, n: int) -> int:
        """Bytes of a message of ``n`` values: 4 per block (scale) + the packed values."""
        values = n if self.bits == 8 else (n + 1) // 2
        return 4 * self.blocks(n) + values

    def quantize(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (1-D, any float dtype) as a uint8 message of ``packed_bytes(x.numel())`` bytes."""
        n, nb = x.numel(), self.blocks(x.numel())
        out = torch.empty(self.packed_bytes(n), dtype=torch.uint8, device=x.device) if out is None else out
        padded = torch.zeros(nb * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x
        rows = padded.view(nb, self.block)
        scales = rows.abs().amax(dim=1).div_(self.qmax)
        # a zero block keeps scale 0 (decodes to zeros); dividing by 1 there avoids 0/0
        q = rows.div_(torch.where(scales > 0, scales, 1.0).unsqueeze(1)).round_().clamp_(-self.qmax, self.qmax)
        out[:4 * nb].copy_(scales.view(torch.uint8))  # as bytes: ``out`` may start at any offset
        values = q.view(-1)[:n].to(torch.int8)
        if self.bits == 8:
            out[4 * nb:].view(torch.int8).copy_(values)
        else:
            nib = (values + 8).to(torch.uint8)
            if n % 2:
                nib = torch.cat([nib, nib.new_full((1,), 8)])
            pairs = nib.view(-1, 2)
            out[4 * nb:] = pairs[:, 0] | (pairs[:, 1] << 4)
        return out

    def dequantize(self, msg: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """Decode a message of ``n`` values into ``out`` (1-D, ``n`` elements, any float dtype)."""
        out.copy_(self._decode(msg, n))
        return out

    def add_decoded(self, msg: torch.Tensor, n: int, acc: torch.Tensor) -> None:
        """``acc += decode(msg)`` (``acc``: fp32, ``n`` elements)."""
        acc.add_(self._decode(msg, n))

    def _decode(self, msg: torch.Tensor, n: int) -> torch.Tensor:
        nb = self.blocks(n)
        scales = msg[:4 * nb].clone().view(torch.float32)  # a copy: a message may start at any offset
        if self.bits == 8:
            values = msg[4 * nb:4 * nb + n].view(torch.int8).to(torch.float32)
        else:
            packed = msg[4 * nb:4 * nb + (n + 1) // 2]
            nib = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)[:n]
            values = nib.to(torch.float32).sub_(8)
        padded = torch.zeros(nb * self.block, dtype=torch.float32, device=msg.device)
        padded[:n] = values
        return padded.view(nb, self.block).mul_(scales.unsqueeze(1)).view(-1)[:n]


# Weights: int8 in blocks of 4096 (DeepSpeed's qwZ aims its groups at 4k-8k values). Gradients: int4
# (DeepSpeed's qgZ) in blocks of 256: small blocks keep int4's step (max/7) near each block's own
# range, which is what keeps the loss on ZeRO-3's (tests/runtime/zero/test_zeropp.py).
WEIGHTS = BlockQuant(bits=8, block=4096)
GRADIENTS = BlockQuant(bits=4, block=256)
