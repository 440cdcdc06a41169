"""DeepSpeed's ``deepspeed.monitor``: TensorBoard, CSV, wandb and Comet monitors of a training run.

``monitor.py``: ``MonitorMaster``, which the engine's observer feeds (one ``Monitor`` per enabled
backend); the backends ``tensorboard.py``, ``csv_monitor.py``, ``wandb.py``, ``comet.py``, each
writing on one background thread (``writer.py``); ``config.py``: DeepSpeed's path of the monitor
blocks (parsed in ``runtime/config/monitors.py``).

Imported lazily: ``config.py`` is torch-free (the ds_config parser reads it).
"""
