"""DeepSpeed's ``deepspeed.env_report`` (``ds_report``, ``python -m deepspeed.env_report``): the
environment report, implemented in ``dslaunch.launcher.env_report``."""

import sys

from dslaunch.launcher.env_report import Item, Section, as_json, as_text, cli_main, collect, main

__all__ = ["Item", "Section", "collect", "as_text", "as_json", "main", "cli_main"]

if __name__ == "__main__":
    sys.exit(cli_main())
