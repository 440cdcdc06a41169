"""``deepspeed.compression.utils``: the fake-quantizers and the top-k mask (from
``dslaunch.runtime.compression.quantizers``)."""

from dslaunch.runtime.compression.quantizers import (
    AsymQuantizer,
    BinaryQuantizer,
    SymQuantizer,
    TernaryQuantizer,
    TopKBinarizer,
)

__all__ = ["TopKBinarizer", "SymQuantizer", "AsymQuantizer", "TernaryQuantizer", "BinaryQuantizer"]
