"""DeepSpeed's ``deepspeed.monitor``: TensorBoard, CSV, wandb and Comet monitors of a training run,
implemented in ``dslaunch.runtime.monitors``.

DeepSpeed's module paths, thin re-exports: ``monitor.py`` (``Monitor``, ``MonitorMaster``),
``tensorboard.py``, ``csv_monitor.py``, ``wandb.py``, ``comet.py``, and ``config.py`` (the monitor
blocks, parsed in ``runtime/config/monitors.py``).

Imported lazily: ``config.py`` is torch-free (the ds_config parser reads it).
"""
