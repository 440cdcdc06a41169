"""DeepSpeed's ``deepspeed.monitor.config``: the monitor blocks, defined with the rest of the
ds_config in ``dslaunch.runtime.config.monitors``."""

from dslaunch.runtime.config.monitors import (
    CometConfig,
    CSVConfig,
    DeepSpeedMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
    check_packages,
)

__all__ = ["TensorBoardConfig", "CSVConfig", "WandbConfig", "CometConfig", "DeepSpeedMonitorConfig",
           "check_packages"]
