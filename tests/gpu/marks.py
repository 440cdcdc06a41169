"""The skips every test of a CUDA device carries (``scripts/gpu/check.sh`` runs them on a lent GPU)."""

from __future__ import annotations

import os

import pytest
import torch

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (scripts/gpu/check.sh runs these)")
"""Skip without a CUDA device (CI never has one)."""

COMPILED_TRITON = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                     reason="TRITON_INTERPRET=1: not the device")
"""Skip where Triton's kernels would run interpreted, not compiled for the device."""
