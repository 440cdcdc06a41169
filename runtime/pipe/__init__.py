"""Ranks on several axes (``topology``: DeepSpeed's ``deepspeed.runtime.pipe.topology``)."""
