"""dslaunch: a DeepSpeed-compatible launcher and ZeRO training engine.

A training script written for DeepSpeed runs unchanged with ``import dslaunch as deepspeed``.

The public API is resolved lazily so that ``import dslaunch`` (done by the ``dslaunch`` command
itself) never pays for importing torch: the launcher starts in milliseconds, only workers import torch.

Layers, lowest first (``tests/test_layering.py`` keeps imports pointing down):

- base: ``errors.py`` (typed user-facing errors), ``safe_write.py`` (every file written on a
  user's behalf), ``textfile.py`` (reading a file a user gave), ``constants.py``, and the shared
  utilities of ``utils/``;
- ``kernels/`` (the dispatched ops), ``runtime/`` (the engines), ``launcher/`` (the command, the
  agents, the monitor): the implementation;
- DeepSpeed's import paths, thin re-exports of the above: ``accelerator/``, ``checkpoint/``,
  ``checkpointing.py``, ``comm/``, ``compression/``, ``elasticity/``, ``env_report.py`` (``ds_report``),
  ``git_version_info.py``, ``inference/``, ``io.py``, ``module_inject/``, ``moe/``, ``monitor/``,
  ``ops/``, ``pipe.py``, ``profiling/``, ``sequence/``, ``zero.py``. ``utils/groups.py`` still
  holds its implementation: the layering test lists it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
# DeepSpeed's build facts, which version checks read (``deepspeed.__git_hash__``)
__git_hash__ = "unknown"
__git_branch__ = "unknown"

# name -> module that defines it; imported on first access.
_LAZY = {
    "initialize": "dslaunch.runtime.api",
    "init_distributed": "dslaunch.runtime.api",
    "add_config_arguments": "dslaunch.runtime.api",
    "DeepSpeedEngine": "dslaunch.runtime.engine",
    "heartbeat": "dslaunch.runtime.heartbeat",
    "init_inference": "dslaunch.runtime.inference.engine",
    "InferenceEngine": "dslaunch.runtime.inference.engine",
    "DslaunchError": "dslaunch.errors",
    "PipelineEngine": "dslaunch.runtime.pipe.engine",
    "DeepSpeedConfig": "dslaunch.runtime.config",
    "get_accelerator": "dslaunch.accelerator",
    "OnDevice": "dslaunch.runtime.zero.partition_parameters",
    # DeepSpeed's fused BERT layer and the surgery that puts it into a model
    "DeepSpeedTransformerLayer": "dslaunch.ops.transformer",
    "DeepSpeedTransformerConfig": "dslaunch.ops.transformer",
    "replace_transformer_layer": "dslaunch.module_inject",
    "revert_transformer_layer": "dslaunch.module_inject",
    # DeepSpeed features dslaunch lacks, importable from the top as DeepSpeed's are; refused on use
    "tp_model_init": "dslaunch.runtime.api",
    "set_autotp_mode": "dslaunch.module_inject",
    "DeepSpeedConfigError": "dslaunch.errors",
    # more of DeepSpeed's top-level names (its __init__ imports them)
    "PipelineModule": "dslaunch.pipe",
    "logger": "dslaunch.utils.logging",
    "log_dist": "dslaunch.utils.logging",
    "TORCH_DISTRIBUTED_DEFAULT_PORT": "dslaunch.constants",
    "DeepSpeedInferenceConfig": "dslaunch.inference",
    "MUON_OPTIMIZER": "dslaunch.runtime.config",
    "DeepSpeedHybridEngine": "dslaunch.runtime.hybrid_engine",
    "version": "dslaunch.git_version_info",
    "git_hash": "dslaunch.git_version_info",
    "git_branch": "dslaunch.git_version_info",
    "DeepSpeedDataLoader": "dslaunch.runtime.dataloader",
    "DeepSpeedOptimizerCallable": "dslaunch.runtime.api",
    "DeepSpeedSchedulerCallable": "dslaunch.runtime.api",
    "DualPipeVModule": "dslaunch.pipe",
    "DualPipeVEngine": "dslaunch.runtime.pipe.dualpipev",
}
# DeepSpeed's ``deepspeed.dist``: its comm module under another name
_MODULE_ALIASES = {"dist": "dslaunch.comm"}

# subpackages reachable as attributes, like ``deepspeed.comm`` / ``deepspeed.zero`` after ``import deepspeed``
_SUBPACKAGES = ("accelerator", "checkpoint", "checkpointing", "comm", "compression", "elasticity", "inference", "io",
                "launcher", "module_inject", "moe", "monitor", "ops", "pipe", "profiling", "runtime", "sequence",
                "utils", "zero")

__all__ = ["__version__", "__git_hash__", "__git_branch__", *_LAZY, *_SUBPACKAGES, *_MODULE_ALIASES]


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _MODULE_ALIASES:
        return importlib.import_module(_MODULE_ALIASES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dslaunch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES) | set(_MODULE_ALIASES))
