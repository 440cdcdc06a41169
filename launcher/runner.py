"""DeepSpeed's ``deepspeed.launcher.runner`` path: the launcher's entry and the env-file name.

accelerate's ``accelerate launch`` reads ``DEEPSPEED_ENVIRONMENT_NAME`` to write the variables
it forwards to other nodes; ``main`` is the ``dslaunch``/``deepspeed`` command, and
``python -m deepspeed.launcher.runner`` (or ``dslaunch.launcher.runner``) runs it.
"""

from __future__ import annotations

from dslaunch.launcher.cli import main
from dslaunch.launcher.envfile import ENV_FILE_NAMES

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]

DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]  # ".deepspeed_env", read from ~ and the working dir

if __name__ == "__main__":  # python -m deepspeed.launcher.runner: DeepSpeed's module entry point
    import sys

    sys.exit(main())
