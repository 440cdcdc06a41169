"""DeepSpeed's ``deepspeed.monitor``: TensorBoard, CSV, wandb and Comet monitors of a training run.

Imported lazily: ``config`` is torch-free (the ds_config parser reads it).
"""
