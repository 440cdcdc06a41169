"""``deepspeed.constants``: the launcher's environment names and defaults DeepSpeed scripts read."""

import os
from datetime import timedelta

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
# DeepSpeed's default process-group timeout (DEEPSPEED_TIMEOUT minutes, else 10), for scripts that pass it
# on; dslaunch's own default when none is passed is runtime.dist.default_timeout()
default_pg_timeout = timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", "10")))
INFERENCE_GENERIC_MODE = "generic"
INFERENCE_SPECIALIZED_MODE = "specialized"
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"

__all__ = ["TORCH_DISTRIBUTED_DEFAULT_PORT", "default_pg_timeout", "INFERENCE_GENERIC_MODE",
           "INFERENCE_SPECIALIZED_MODE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_RANK"]
