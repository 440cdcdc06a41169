"""``python -m dslaunch.launcher.agent``: run one node from a NodeSpec line on stdin."""

import sys

from dslaunch.launcher.agent.remote import main

sys.exit(main())
