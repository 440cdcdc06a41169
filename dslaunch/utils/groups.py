"""``deepspeed.utils.groups``: this rank's data-, model-, sequence- and expert-parallel groups.

Implemented by ``dslaunch.runtime.parallel.deepspeed_groups``; this name is that same module
object, not a copy of its names, because DeepSpeed's code reads (and the engine sets) the module's
``mpu`` and ``grid`` globals: a copy would keep answering from stale ones.
"""

import sys

from dslaunch.runtime.parallel import deepspeed_groups

sys.modules[__name__] = deepspeed_groups
