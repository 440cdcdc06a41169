"""The ds_config ``autotuning`` block: DeepSpeed's keys and defaults, plus dslaunch's own.

``{"autotuning": {"enabled": true, "metric": "throughput", "tuner_type": "model_based",
"start_profile_step": 3, "end_profile_step": 5, "memory_per_device": 2e9}}``

Two readers: ``dslaunch --autotuning tune|run`` (``dslaunch.launcher.autotuning``) reads the block
of the script's ``--deepspeed_config`` to plan the search; inside an experiment the engine reads
``metric_path`` (set by the tuner) and profiles the steps ``start_profile_step`` to
``end_profile_step`` (``runtime/autotuning.py``). A training run started without the tuner
ignores the block, as DeepSpeed's engine does unless its own autotuner set ``metric_path``.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, choice, describe, integer, number
from dslaunch.runtime.config.sections import _opt, optional

__all__ = ["AutotuningConfig", "METRICS", "TUNERS"]

METRICS = ("throughput", "latency", "flops")
TUNERS = ("gridsearch", "random", "model_based")


def _path(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError(f"must be a path (a non-empty string without NUL), got {describe(value)}", key=path)
    return value


def _metric(path: str, value: Any) -> str:
    # DeepSpeed's users write "flops" or "FLOPS"
    return choice(*METRICS)(path, value.lower() if isinstance(value, str) else value)


def _arg_mappings(path: str, value: Any) -> Mapping[str, str]:
    """ds_config key -> the script flag that carries it (Hugging Face scripts take the batch size
    as ``--per_device_train_batch_size``)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v.startswith("-")
                                                 for k, v in value.items()):
        raise ConfigError("must map ds_config keys to script flags, e.g. {\"train_micro_batch_size_per_gpu\": "
                          f"\"--per_device_train_batch_size\"}}, got {describe(value)}", key=path)
    return dict(value)


def _model_info(path: str, value: Any) -> Mapping[str, Any]:
    known = {"num_params": integer(1), "hidden_size": integer(1), "num_layers": integer(1), "profile": boolean}
    if not isinstance(value, Mapping):
        raise ConfigError(f"must be an object such as {{\"num_params\": 1000000}}, got {describe(value)}", key=path)
    for key, item in value.items():
        if key not in known:
            raise ConfigError(f"unknown key; valid: {', '.join(known)}", key=f"{path}.{key}")
        known[key](f"{path}.{key}", item)
    return dict(value)


@dataclass(frozen=True)
class AutotuningConfig:
    """``autotuning``: what ``dslaunch --autotuning`` searches and how each experiment is measured."""

    enabled: bool = _opt(False, boolean, "true or false")
    fast: bool = _opt(True, boolean, "true to tune the stage, offload, activation checkpointing and the "
                      "batch only; false to tune bucket sizes, overlap and accumulation too")
    results_dir: str = _opt("autotuning_results", _path, "a directory for the results table and best config")
    exps_dir: str = _opt("autotuning_exps", _path, "a directory for each experiment's config and logs")
    overwrite: bool = _opt(True, boolean, "false to reuse the results of experiments already in exps_dir")
    start_profile_step: int = _opt(3, integer(1), "the optimizer step after which timing starts, e.g. 3")
    end_profile_step: int = _opt(5, integer(2), "the optimizer step at which timing ends and the "
                                 "experiment stops, e.g. 5")
    metric: str = _opt("throughput", _metric, "throughput, latency or flops")
    metric_path: str | None = _opt(None, optional(_path), "where an experiment writes its metrics (the tuner "
                                   "sets it)")
    tuner_type: str = _opt("gridsearch", choice(*TUNERS), "gridsearch, random or model_based")
    tuner_early_stopping: int = _opt(5, integer(1), "experiments in a row without a better result before "
                                     "the search stops, e.g. 5")
    tuner_num_trials: int = _opt(50, integer(1), "the most experiments to run, e.g. 50")
    arg_mappings: Mapping[str, str] | None = _opt(None, optional(_arg_mappings), "ds_config keys -> script "
                                                  "flags")
    model_info: Mapping[str, Any] | None = _opt(None, optional(_model_info), "{\"num_params\": N} to skip "
                                                "the profiling experiment")
    model_info_path: str | None = _opt(None, optional(_path), "a file with the model info (JSON), to skip "
                                       "the profiling experiment")
    mp_size: int = _opt(1, integer(1), "model-parallel ranks per data-parallel replica, e.g. 1")
    max_train_batch_size: int | None = _opt(None, optional(integer(1)), "the largest global batch to try")
    min_train_batch_size: int = _opt(1, integer(1), "the smallest global batch to try")
    max_train_micro_batch_size_per_gpu: int = _opt(1024, integer(1), "the largest micro batch to try")
    min_train_micro_batch_size_per_gpu: int = _opt(1, integer(1), "the smallest micro batch to try")
    num_tuning_micro_batch_sizes: int = _opt(3, integer(1), "micro batch sizes tried per configuration, "
                                             "e.g. 3")
    # dslaunch's own keys
    memory_per_device: int | None = _opt(None, optional(integer(1)), "bytes one rank may use, e.g. 2e9 "
                                         "(default: the GPU's memory; on CPU the host's RAM over its ranks)")
    experiment_timeout: float = _opt(600.0, number(1.0, 86400.0), "seconds before an experiment is "
                                     "stopped, e.g. 600")
    hang_timeout: float = _opt(60.0, number(2.0, 86400.0), "seconds without a step before an experiment "
                               "is hung, e.g. 60")
    offload: bool = _opt(True, boolean, "false to leave offload out of the search")
    activation_checkpointing: bool = _opt(True, boolean, "false to leave activation checkpointing out of "
                                          "the search (a script uses it when deepspeed.checkpointing."
                                          "is_configured())")
    seed: int = _opt(0, integer(0), "the random and model_based tuners' seed")

    UNIMPLEMENTED = {}  # noqa: RUF012

    def check(self) -> None:
        """Cross-checks between keys.

        Raises:
            ConfigError: naming the key.
        """
        if self.end_profile_step <= self.start_profile_step:
            raise ConfigError(f"{self.end_profile_step} must be above start_profile_step "
                              f"({self.start_profile_step}): the steps between them are timed",
                              key="autotuning.end_profile_step")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ConfigError(f"{self.max_train_micro_batch_size_per_gpu} is below "
                              f"min_train_micro_batch_size_per_gpu ({self.min_train_micro_batch_size_per_gpu})",
                              key="autotuning.max_train_micro_batch_size_per_gpu")
        if self.max_train_batch_size is not None and self.max_train_batch_size < self.min_train_batch_size:
            raise ConfigError(f"{self.max_train_batch_size} is below min_train_batch_size "
                              f"({self.min_train_batch_size})", key="autotuning.max_train_batch_size")
