"""``deepspeed.checkpoint.zero_checkpoint``: ``ZeROCheckpoint``
(``dslaunch.runtime.checkpoint.deepspeed_zero_files``)."""

from dslaunch.runtime.checkpoint.deepspeed_zero_files import GROUP_STATE_KEY, ZeROCheckpoint

__all__ = ["GROUP_STATE_KEY", "ZeROCheckpoint"]
