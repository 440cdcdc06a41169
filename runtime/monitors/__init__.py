"""The monitors of a training run: DeepSpeed's TensorBoard, CSV, wandb and Comet writers
(``deepspeed.monitor``, which ``dslaunch.monitor`` re-exports), configured by the ds_config blocks
of ``dslaunch.runtime.config.monitors``.

``monitor.py``: ``MonitorMaster``, which the engine's observer feeds (one ``Monitor`` per enabled
backend); the backends ``tensorboard.py``, ``csv_monitor.py``, ``wandb.py``, ``comet.py``, each
writing on one background thread (``writer.py``). Imported lazily: a backend's package (tensorboard,
wandb, comet_ml) is imported only when its block is enabled.
"""
