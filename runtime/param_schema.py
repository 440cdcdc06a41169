"""The old path of ``dslaunch.runtime.config.param_schema`` (one module object under both names).

Kept only while ``optimizers.py``, ``lr_schedules.py`` and ``dist.py`` import it from here; drop
it once they import ``dslaunch.runtime.config.param_schema``.
"""

import sys

from dslaunch.runtime.config import param_schema

sys.modules[__name__] = param_schema
