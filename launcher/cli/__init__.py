"""The ``dslaunch`` command line: the launch command (``launch``) and the subcommands."""

from dslaunch.launcher.cli.launch import build_parser, main, parse_config

__all__ = ["main", "build_parser", "parse_config"]
