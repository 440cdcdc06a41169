"""The ds_config's monitor blocks ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet``, with
DeepSpeed's key names and defaults (DeepSpeed's ``deepspeed.monitor.config`` re-exports them).

Each block is a frozen dataclass parsed by ``runtime.config.sections.parse_section`` (unknown keys
get a did-you-mean, wrong types name the key path). ``DeepSpeedMonitorConfig`` groups the four, as
DeepSpeed's ``ds_config.monitor_config``. Torch-free.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, choice, describe, integer, string
from dslaunch.runtime.config.sections import _opt, optional

__all__ = ["TensorBoardConfig", "CSVConfig", "WandbConfig", "CometConfig", "DeepSpeedMonitorConfig",
           "check_packages"]


def _name(path: str, value: object) -> str:
    """A non-empty string that is one path component (it names a directory)."""
    text = string(path, value)
    if not text or "/" in text or text in (".", ".."):
        raise ConfigError(f"must be a non-empty name without '/', got {describe(value)}", key=path)
    return text


@dataclass(frozen=True)
class _FilesConfig:
    """A monitor that writes files under ``output_path/job_name/`` (rank 0)."""

    enabled: bool = _opt(False, boolean, "true or false")
    output_path: str = _opt("", string, "a directory (\"\": the working directory)")
    job_name: str = _opt("DeepSpeedJobName", _name, "a directory name for this run, e.g. \"gpt_lr3e-4\"")

    UNIMPLEMENTED = {}  # noqa: RUF012


@dataclass(frozen=True)
class TensorBoardConfig(_FilesConfig):
    """``tensorboard``: TensorBoard event files under ``output_path/job_name/``."""


@dataclass(frozen=True)
class CSVConfig(_FilesConfig):
    """``csv_monitor``: one CSV file per metric under ``output_path/job_name/``."""


@dataclass(frozen=True)
class WandbConfig:
    """``wandb``: a Weights & Biases run (rank 0); ``team`` is wandb's entity."""

    enabled: bool = _opt(False, boolean, "true or false")
    group: str | None = _opt(None, optional(string), "a run group name, or null")
    team: str | None = _opt(None, optional(string), "a team (entity) name, or null")
    project: str = _opt("deepspeed", string, "a project name, e.g. \"deepspeed\"")

    UNIMPLEMENTED = {}  # noqa: RUF012


@dataclass(frozen=True)
class CometConfig:
    """``comet``: a Comet experiment (rank 0); each metric at most once per ``samples_log_interval``
    samples."""

    enabled: bool = _opt(False, boolean, "true or false")
    samples_log_interval: int = _opt(100, integer(0), "samples between two logs of a metric, e.g. 100")
    project: str | None = _opt(None, optional(string), "a project name, or null")
    workspace: str | None = _opt(None, optional(string), "a workspace name, or null")
    api_key: str | None = _opt(None, optional(string), "an API key, or null (then COMET_API_KEY)")
    experiment_name: str | None = _opt(None, optional(string), "a name for the experiment, or null")
    experiment_key: str | None = _opt(None, optional(string), "an experiment key to resume, or null")
    online: bool | None = _opt(None, optional(boolean), "true, false (offline archive) or null")
    mode: str | None = _opt(None, optional(choice("get", "create", "get_or_create")),
                            "\"get\", \"create\", \"get_or_create\" or null")

    UNIMPLEMENTED = {}  # noqa: RUF012


@dataclass(frozen=True)
class DeepSpeedMonitorConfig:
    """The four monitor blocks, as DeepSpeed's ``DeepSpeedConfig.monitor_config``."""

    tensorboard: TensorBoardConfig = TensorBoardConfig()
    wandb: WandbConfig = WandbConfig()
    csv_monitor: CSVConfig = CSVConfig()
    comet: CometConfig = CometConfig()

    @property
    def enabled(self) -> bool:
        return any(b.enabled for b in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))


# block -> (the module it needs, the pip package that provides it)
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "comet": ("comet_ml", "comet-ml")}


def check_packages(cfg: DeepSpeedMonitorConfig) -> None:
    """Fail before training if an enabled monitor's package is not installed.

    Raises:
        ConfigError: naming the block's ``enabled`` key and the package to install.
    """
    for block, (module, package) in _PACKAGES.items():
        if getattr(cfg, block).enabled and importlib.util.find_spec(module) is None:
            raise ConfigError(f"true needs the '{package}' package, which is not installed: "
                              f"pip install {package} (or pip install 'dslaunch[monitor]')",
                              key=f"{block}.enabled")
