"""The agent's wire protocol: how a remote agent tells the controller how its node is doing.

Two machine-readable lines on the agent's stderr, each one ``NodeResult`` as JSON after a marker:
the failure line as soon as the node's first worker failed (so the controller stops the other
nodes while this one is still stopping its own workers), and the status line just before the
agent exits (how the node ended). Every other line is output for the user.
"""

from __future__ import annotations

from dslaunch.launcher.spec import NodeResult

__all__ = ["format_status_line", "parse_status_line", "format_failure_line", "parse_failure_line"]

STATUS_MARKER = "@@dslaunch-agent-status "
FAILURE_MARKER = "@@dslaunch-agent-failure "


def format_status_line(result: NodeResult) -> str:
    """One machine-readable line (no newline) the agent prints on stderr before exiting."""
    return STATUS_MARKER + result.to_json()


def parse_status_line(line: str | bytes) -> NodeResult | None:
    """The ``NodeResult`` carried by an agent status line, or None for any other line."""
    return _parse_marked(line, STATUS_MARKER)


def format_failure_line(failure: NodeResult) -> str:
    """The line (no newline) the agent prints on stderr as soon as its first worker failed."""
    return FAILURE_MARKER + failure.to_json()


def parse_failure_line(line: str | bytes) -> NodeResult | None:
    """The first failure carried by an agent failure line, or None for any other line."""
    return _parse_marked(line, FAILURE_MARKER)


def _parse_marked(line: str | bytes, marker: str) -> NodeResult | None:
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith(marker):
        return None
    try:
        return NodeResult.from_json(line[len(marker):])
    except (ValueError, TypeError, KeyError):
        return None
