"""``data_types.keep_in_fp32_modules``: the buffers a 16-bit model keeps in fp32, as DeepSpeed 0.19.8.

The setting is a list of name patterns (``*`` a wildcard), or ``"auto"``/None: the patterns Hugging
Face models declare (``_keep_in_fp32_modules_strict``, and under fp16 ``_keep_in_fp32_modules``), each
under the declaring module's name. A buffer whose full name matches (``re.search``, as transformers
matches them) stays fp32 when ``data_types.buffer_dtype`` casts the rest, and one loaded in lower
precision is brought up to fp32. Parameters are cast to the model dtype either way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

__all__ = ["keep_in_fp32_pattern", "buffers_to_keep_in_fp32", "keep_buffers_in_fp32", "KEEP_IN_FP32_AUTO"]

AUTO = KEEP_IN_FP32_AUTO = "auto"  # the second: DeepSpeed's name


def keep_in_fp32_pattern(module: torch.nn.Module, setting: Sequence[str] | str | None,
                         dtype: torch.dtype) -> re.Pattern | None:
    """The compiled pattern of ``module``'s tensor names to keep in fp32 under ``dtype`` training;
    None when there are none (always under fp32)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if setting is None or setting == AUTO:
        patterns = set()
        for name, child in module.named_modules():
            declared = set(getattr(child, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                declared |= set(getattr(child, "_keep_in_fp32_modules", None) or ())
            for pattern in (p.replace("*", ".*") for p in declared):
                patterns.add(rf"^{re.escape(name)}\..*{pattern}" if name else pattern)
    else:
        patterns = {p.replace("*", ".*") for p in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def buffers_to_keep_in_fp32(module: torch.nn.Module, pattern: re.Pattern) -> list[torch.Tensor]:
    """The floating-point buffers of ``module`` whose full names match ``pattern``."""
    return [b for name, b in module.named_buffers() if b.is_floating_point() and pattern.search(name)]


def keep_buffers_in_fp32(module: torch.nn.Module, pattern: re.Pattern) -> int:
    """Turn the matching buffers of ``module`` to fp32 in place (what the engine does at
    ``initialize``); how many were not fp32 before."""
    changed = [b for b in buffers_to_keep_in_fp32(module, pattern) if b.dtype != torch.float32]
    for buffer in changed:
        buffer.data = buffer.data.float()
    return len(changed)
