"""The ds_config ``tensor_parallel`` block: AutoTP training (DeepSpeed 0.16.4+).

``{"tensor_parallel": {"autotp_size": 2}}``

``autotp_size`` > 1 splits every transformer layer of the model over that many ranks
(``runtime/tensor_parallel/``); the data-parallel degree is what the world leaves. 0 or 1 is off.
The rest of DeepSpeed's keys are checked: ``dtype`` and ``tp_overlap_comm`` change nothing (the
precision is the ``fp16``/``bf16`` blocks'; the all-reduces are not overlapped), ``tp.tp_size``
must repeat ``autotp_size``. ``partition_config`` (DeepSpeed's hand-written layer rules,
``partition_config.py``) replaces the planner's dataflow for the model; the other hand-written
forms (``preset_model``, ``injection_policy_tuple``) are refused: dslaunch's planner finds the
layers from the model's dataflow. ``loss_parallel`` (dslaunch's) keeps the logits split over the
vocabulary into the loss; DeepSpeed 0.19.8's ``vocab_parallel_lm_head: true`` asks for the same
(its ``vocab_parallel_ce_backend`` takes ``"torch"``, the loss dslaunch computes). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, describe, integer
from dslaunch.runtime.config.partition_config import PartitionConfig, parse_partition_config
from dslaunch.runtime.config.sections import _opt, optional

__all__ = ["TensorParallelConfig"]

_DTYPES = ("fp16", "float16", "torch.float16", "bf16", "bfloat16", "torch.bfloat16", "fp32", "float32",
           "float", "torch.float32")
_PLANNER = "dslaunch's AutoTP finds the column/row layers from the model's dataflow"


def _dtype(path: str, value: Any) -> str:
    if not isinstance(value, str) or value not in _DTYPES:
        raise ConfigError(f"must be a dtype name ({', '.join(_DTYPES[:6])}, fp32...), got {describe(value)}",
                          key=path)
    return value


def _tp(path: str, value: Any) -> Mapping[str, Any]:
    """DeepSpeed's inner ``tp`` block: ``tp_size`` (1 or the autotp_size, checked by the section)
    and ``tp_grain_size`` (1: DeepSpeed's training ignores it too)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"must be an object, got {describe(value)}", key=path)
    for key, item in value.items():
        if key not in ("tp_size", "tp_grain_size"):
            raise ConfigError("unknown key; valid keys: tp_size, tp_grain_size", key=f"{path}.{key}")
        integer(1)(f"{path}.{key}", item)
    return value


def _ce_backend(path: str, value: Any) -> str:
    if value != "torch":
        raise ConfigError(f"{describe(value)} is not in dslaunch (DeepSpeed's Liger kernel backend); the vocab-parallel "
                          "loss is computed in torch: set it to \"torch\" or remove it", key=path)
    return value


def _refused(what: str) -> Any:
    def check(path: str, value: Any) -> None:
        if value is not None:
            raise ConfigError(f"is not implemented by dslaunch ({what}: {_PLANNER}); remove the key", key=path)

    return check


@dataclass(frozen=True)
class TensorParallelConfig:
    """``tensor_parallel``: the AutoTP degree for training."""

    autotp_size: int = _opt(0, integer(0), "ranks that split each layer, e.g. 2 (0 or 1: off)")
    """Tensor-parallel degree; it must divide the world (data parallel = world / autotp_size)."""
    tp: Mapping[str, Any] | None = _opt(None, _tp, "an object {\"tp_size\": <autotp_size>}")
    """DeepSpeed's inner block; ``tp.tp_size`` other than 1 must equal ``autotp_size``."""
    loss_parallel: bool = _opt(False, boolean, "true or false")
    """dslaunch's (torchtitan's name; DeepSpeed 0.19.8's ``vocab_parallel_lm_head``): the output layer's logits stay split
    over the vocabulary and the model's ``loss_function`` (Hugging Face's hook) becomes the
    vocab-parallel cross-entropy (``runtime/tensor_parallel/loss.py``); ``outputs.logits`` is then
    this rank's slice of the vocabulary."""
    vocab_parallel_lm_head: bool | None = _opt(None, optional(boolean), "true, false or null")
    """DeepSpeed 0.19.8's name for ``loss_parallel``: true asks for it; false or null (DeepSpeed: a
    Hugging Face tied-embedding plan decides) leave ``loss_parallel`` as set."""
    vocab_parallel_ce_backend: str = _opt("torch", _ce_backend, "\"torch\"")
    partition_config: PartitionConfig | None = _opt(None, parse_partition_config,
                                                    "an object {\"layer_specs\": [{\"patterns\": [...], "
                                                    "\"partition_type\": \"column\"}, ...]}")
    """DeepSpeed's hand-written layer rules: which Linears are column-, row-split or kept whole, by
    weight name (``runtime/config/partition_config.py``); they replace the dataflow planner."""

    INERT = {"dtype": _dtype, "tp_overlap_comm": boolean, "keep_module_on_host": boolean,  # noqa: RUF012
             "preset_model": _refused("model presets"),
             "injection_policy_tuple": _refused("an injection policy")}
    UNIMPLEMENTED = {}  # noqa: RUF012

    @property
    def vocab_parallel(self) -> bool:
        """The output layer stays split over the vocabulary into the loss (either key asks for it)."""
        return self.loss_parallel or self.vocab_parallel_lm_head is True

    @property
    def vocab_parallel_key(self) -> str:
        """The key that asked for it, for messages."""
        return "tensor_parallel.loss_parallel" if self.loss_parallel else "tensor_parallel.vocab_parallel_lm_head"

    @property
    def size(self) -> int:
        """The tensor-parallel degree (1 when off)."""
        return max(self.autotp_size, 1)

    def check(self, zero_stage: int) -> None:
        """The combinations DeepSpeed refuses, one line each. Every ZeRO stage composes with AutoTP
        (stage 3 partitions each slice over its data-parallel ranks, as DeepSpeed 0.19.4+), so
        ``zero_stage`` refuses nothing.

        Raises:
            ConfigError: ``tp.tp_size`` differing from ``autotp_size``.
        """
        inner = (self.tp or {}).get("tp_size", 1)
        if self.size > 1 and inner not in (1, self.autotp_size):
            raise ConfigError(f"{inner} does not match tensor_parallel.autotp_size ({self.autotp_size}); "
                              "remove it or make them equal", key="tensor_parallel.tp.tp_size")
