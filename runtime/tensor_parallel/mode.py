"""DeepSpeed's AutoTP mode (``deepspeed.module_inject.layers.set_autotp_mode``): training or inference.

DeepSpeed keeps it process-wide and so does this module (its one piece of state): ``initialize``
with ``tensor_parallel.autotp_size`` (or after ``tp_model_init``) switches it to training, and the
layers built by hand (``deepspeed_layers.py``) read it when they are built: in training their
parameters keep ``requires_grad``, in inference they are frozen. dslaunch's own AutoTP paths do not
read it (``init_inference`` freezes, ``initialize`` trains). Torch-free.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["AUTOTP_MODE", "set_autotp_mode", "is_autotp_training_mode", "get_auto_tp_mode"]


class AUTOTP_MODE(Enum):  # noqa: N801 - DeepSpeed's name
    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"


_mode = {"current": AUTOTP_MODE.INFERENCE}  # process-wide, as DeepSpeed's module global


def set_autotp_mode(training: bool = False) -> None:
    """Training (``True``) or inference (``False``, DeepSpeed's default) for the layers built next."""
    _mode["current"] = AUTOTP_MODE.TRAINING if training else AUTOTP_MODE.INFERENCE


def get_auto_tp_mode() -> AUTOTP_MODE:
    return _mode["current"]


def is_autotp_training_mode() -> bool:
    return _mode["current"] is AUTOTP_MODE.TRAINING
