"""The old path of ``dslaunch.runtime.checkpoint.export`` (one module object under both names).

Kept only while ``launcher/cli.py`` and ``dslaunch/utils/zero_to_fp32.py`` import it from here;
drop it once they import ``dslaunch.runtime.checkpoint.export``.
"""

import sys

from dslaunch.runtime.checkpoint import export

if __name__ == "__main__":
    export.run_as_script()
else:
    sys.modules[__name__] = export
