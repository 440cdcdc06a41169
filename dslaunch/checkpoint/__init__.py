"""``dslaunch.checkpoint`` (DeepSpeed's ``deepspeed.checkpoint``): helpers for saving what the
engine holds with ``torch.save`` (``utils.py``: ``clone_tensors_for_torch_save``). The engine's
own checkpoints are ``dslaunch.runtime.checkpoint``.
"""
