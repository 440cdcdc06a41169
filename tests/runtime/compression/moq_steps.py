"""The optimizer-step weight quantizer (MoQ) driven alone, the same way on both sides: weights
with a bits schedule, quantized once per step (an SGD step between), the bits and the weights
recorded each step. Pure torch; the caller passes the ``Quantizer`` class."""

from __future__ import annotations

from typing import Any

import torch

STEPS = 14
# (q_groups, mixed fp16, change ratio, type, start bits, target bits, period)
CASES = {"sym": (1, False, 0.1, "symmetric", 8, 4, 2), "asym_groups": (4, False, 0.1, "asymmetric", 6, 3, 1),
         "mixed": (2, True, 0.25, "symmetric", 5, 4, 3), "ternary": (1, False, 0.1, "symmetric", 4, 2, 2),
         "binary": (2, False, 0.1, "symmetric", 3, 1, 1)}


def run(quantizer_class: Any) -> dict:
    out = {}
    for name, (groups, mixed, ratio, qtype, start, target, period) in CASES.items():
        torch.manual_seed(5)
        w = torch.nn.Parameter(torch.randn(8, 12))
        w.start_bits, w.target_bits, w.q_period = start, target, period
        q = quantizer_class(groups, mixed, ratio, qtype, "nearest", False, False, False, 0)
        bits, values = [], []
        for _ in range(STEPS):
            with torch.no_grad():
                w.add_(torch.randn(8, 12) * 0.01)  # a stand-in optimizer step
            q.quantize([[w]], False, False, None)
            bits.append(w.start_bits)
            values.append(w.detach().double().flatten().tolist())
        out[name] = {"bits": bits, "values": values, "period": w.q_period}
    return out
