"""``deepspeed.checkpoint.constants``: the key and file-name strings of DeepSpeed's checkpoints
(``dslaunch.runtime.checkpoint.deepspeed_constants``)."""

from dslaunch.runtime.checkpoint.deepspeed_constants import *  # noqa: F403
from dslaunch.runtime.checkpoint.deepspeed_constants import __all__  # noqa: F401
