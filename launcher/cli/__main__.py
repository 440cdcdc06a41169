"""``python -m dslaunch.launcher.cli``: the ``dslaunch`` command."""

import sys

from dslaunch.launcher.cli import main

sys.exit(main())
