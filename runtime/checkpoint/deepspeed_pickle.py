"""Serializing checkpoint files that name DeepSpeed's own classes, without DeepSpeed installed.

DeepSpeed 0.19 pickles a few of its objects into its files (its ``LossScaler`` in every ZeRO
optimizer file, ``fragment_address`` records in ``param_slice_mappings``), and its ZeRO-3 load reads
the loss scaler back as an object (``state_dict['loss_scaler']``, no default). dslaunch writes
those files for DeepSpeed to load, so they must name DeepSpeed's classes, never dslaunch's:
``DeepSpeedObject`` is such an object (a class path, constructor arguments, attributes), and
``to_bytes`` pickles it as a reference to that class, which DeepSpeed's unpickler imports. Nothing
here imports DeepSpeed; dslaunch reads such files back with stand-ins (``deepspeed_read``).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DeepSpeedObject", "loss_scaler", "fragment_address", "to_bytes"]


@dataclass(frozen=True)
class DeepSpeedObject:
    """An instance of DeepSpeed's class ``path`` (``module.Name``), built on unpickling with
    ``cls(*args)``, then its ``__dict__`` updated with ``attrs``."""

    path: str
    args: tuple = ()
    attrs: dict[str, Any] = field(default_factory=dict)


def loss_scaler(scale: float = 1.0) -> DeepSpeedObject:
    """DeepSpeed's static ``LossScaler(scale)`` (what its fp32 and bf16 optimizers hold)."""
    return DeepSpeedObject("deepspeed.runtime.fp16.loss_scaler.LossScaler", (float(scale),),
                           {"cur_scale": float(scale), "dynamic": False})


def fragment_address(numel: int, start: int) -> DeepSpeedObject:
    """One parameter's fragment in a rank's ZeRO-1/2 partition (``param_slice_mappings``)."""
    # the fields as attributes too: DeepSpeed pickles its dataclass with them, and a reader without
    # DeepSpeed (dslaunch's stand-ins, deepspeed.checkpoint's tools) finds them there
    fields = {"numel": int(numel), "start": int(start)}
    return DeepSpeedObject("deepspeed.utils.tensor_fragment.fragment_address", (fields["numel"], fields["start"]), fields)


class _ClassRef:
    """A class named only by its path: pickled as a global that the unpickler imports."""

    def __init__(self, path: str) -> None:
        self.module, _, self.name = path.rpartition(".")

    def __call__(self) -> None:  # pickle's save_reduce wants a callable; never called here
        raise AssertionError(self.name)


class _Pickler(pickle._Pickler):
    """The pure-Python pickler, taught to write a ``DeepSpeedObject`` as a call of its class
    (by name) and its attributes."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, DeepSpeedObject):
            return _ClassRef(obj.path), tuple(obj.args), dict(obj.attrs) or None
        return NotImplemented

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _ClassRef):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            return
        super().save(obj, save_persistent_id)


class _PickleModule:
    """What ``torch.save(pickle_module=...)`` needs: this module's pickler."""

    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    __name__ = "pickle"


def to_bytes(obj: Any) -> bytes:
    """``torch.save``'s zip format of ``obj``, ``DeepSpeedObject`` values as DeepSpeed's classes."""
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=_PickleModule)  # into memory; the caller writes it via safe_write
    return buf.getvalue()
