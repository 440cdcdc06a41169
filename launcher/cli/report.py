"""``dslaunch report [--json]``: the environment report (``ds_report`` under DeepSpeed's name).

A thin click command over ``dslaunch.launcher.env_report`` (which imports torch, only when this runs).
"""

from __future__ import annotations

import click

__all__ = ["command"]


@click.command("report")
@click.option("--json", "as_json", is_flag=True, help="JSON for tools: {section: {key: value}}, notes, warnings.")
@click.option("--hide_operator_status", is_flag=True, help="Leave out the kernels section (ds_report's flag).")
@click.option("--hide_errors_and_warnings", is_flag=True, help="Leave out notes and warnings (ds_report's flag).")
def command(as_json: bool, hide_operator_status: bool, hide_errors_and_warnings: bool) -> int:
    """Versions, devices, NVML, compilers, kernels, network interfaces, launchers, install paths."""
    from dslaunch.launcher.env_report import main

    main(hide_operator_status, hide_errors_and_warnings, as_json)
    return 0
