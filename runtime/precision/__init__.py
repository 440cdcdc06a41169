"""``dslaunch.runtime.precision``: how numbers are represented during training.

Owns the precision policy (``policy.py``: model dtype, communication dtype, and which loss
scaler a config asks for) and the loss scaler strategies (``loss_scaler.py``: dynamic, static,
none; scale, overflow bookkeeping, ``state_dict``), and which buffers a 16-bit model keeps in fp32
(``keep_in_fp32.py``). The engine picks them once, from the parsed ``fp16``/``bf16`` sections.
"""

from dslaunch.runtime.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    NoLossScaler,
    StaticLossScaler,
    build_loss_scaler,
)
from dslaunch.runtime.precision.policy import PrecisionPolicy

__all__ = ["PrecisionPolicy", "LossScaler", "DynamicLossScaler", "StaticLossScaler", "NoLossScaler",
           "LossScaleAtMinimumError", "build_loss_scaler"]
