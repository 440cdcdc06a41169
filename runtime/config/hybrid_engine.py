"""The ds_config ``hybrid_engine`` block: DeepSpeed's hybrid engine (DeepSpeed-Chat's RLHF actor),
one engine that trains and generates.

``{"hybrid_engine": {"enabled": true, "pin_parameters": true}}``

With it ``initialize`` returns a ``DeepSpeedHybridEngine`` (``runtime/hybrid_engine.py``) whose
``generate`` runs the model's own ``generate``; at ZeRO-3 with ``pin_parameters`` every partitioned
parameter is gathered once for the whole generation instead of module by module at every token.
DeepSpeed's inference kernels are not used (DeepSpeed too falls back to the model's own generate
for models it has no kernels for), so ``max_out_tokens`` (their cache size) and
``release_inference_cache`` change nothing; ``inference_tp_size`` above 1 and
``enable_cuda_graph`` are refused in one line. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, integer
from dslaunch.runtime.config.sections import _only, _opt

__all__ = ["HybridEngineConfig"]


def _one(path: str, value: object) -> int:
    tp = integer(1)(path, value)
    if tp != 1:
        raise ConfigError(f"{tp} is not implemented by dslaunch yet: generation runs the model's own generate "
                          "with the training layout, not DeepSpeed's tensor-parallel inference kernels; set it "
                          "to 1 (or use AutoTP training, tensor_parallel.autotp_size)", key=path)
    return tp


@dataclass(frozen=True)
class HybridEngineConfig:
    """``hybrid_engine``: DeepSpeed 0.19.8's keys and defaults."""

    enabled: bool = _opt(False, boolean, "true to train and generate with one engine")
    max_out_tokens: int = _opt(512, integer(1), "tokens DeepSpeed's inference cache holds (unused here)")
    inference_tp_size: int = _opt(1, _one, "1")
    release_inference_cache: bool = _opt(False, boolean, "true or false (no inference cache here)")
    pin_parameters: bool = _opt(True, boolean, "true to gather a ZeRO-3 model once per generate call")
    tp_gather_partition_size: int = _opt(8, integer(1), "layers gathered at once for tensor-parallel "
                                         "generation (unused here)")
    enable_cuda_graph: bool = _opt(False, _only(False, "decoding runs eagerly, without CUDA graphs"), "false")

    UNIMPLEMENTED = {}  # noqa: RUF012
