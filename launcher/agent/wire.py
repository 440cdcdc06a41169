"""The agent's wire protocol: how a remote agent tells the controller how its node is doing.

Machine-readable lines on the agent's stderr, each a JSON payload after a marker; every other
line is output for the user:

- the failure line (a ``NodeResult``) as soon as the node's first worker failed, so the
  controller stops the other nodes while this one is still stopping its own workers;
- the status line (a ``NodeResult``) just before the agent exits: how the node ended;
- the beats line (rank -> latest ``Beat``), at most every ``BEATS_EVERY_S`` while beats change,
  and at least every ``ALIVE_EVERY_S`` (perhaps empty or unchanged): the controller takes a host
  that sent nothing for a few of these intervals as lost (``monitor.gang.HOST_SILENT_S``), also
  when its workers never beat;
- the stacks line (rank -> ``{"stopped", "stack"}``), the answer to a ``STACKS_REQUEST``.

And the other way, on the agent's stdin after the NodeSpec line: ``STACKS_REQUEST`` asks for
every worker's stacks; ``CHECKPOINT_REQUEST`` asks every worker that takes it for a checkpoint
(pre-emption, ``runtime.preempt``); ``ALIVE`` every ``ALIVE_EVERY_S``: the controller lives (once
one came, an agent that hears nothing for ``CONTROLLER_SILENT_S`` takes the controller as gone,
stops its workers and exits: behind a cut link its sshd would not notice, since the agent's own
liveness lines keep that sshd busy and its ClientAlive check never runs); EOF is the stop request.
"""

from __future__ import annotations

import json
from typing import Any

from dslaunch.launcher.spec import NodeResult
from dslaunch.utils.beat import Beat

__all__ = ["format_status_line", "parse_status_line", "format_failure_line", "parse_failure_line",
           "format_beats_line", "parse_beats_line", "format_stacks_line", "parse_stacks_line",
           "STACKS_REQUEST", "CHECKPOINT_REQUEST", "ALIVE", "BEATS_EVERY_S", "ALIVE_EVERY_S",
           "CONTROLLER_SILENT_S"]

STATUS_MARKER = "@@dslaunch-agent-status "
FAILURE_MARKER = "@@dslaunch-agent-failure "
BEATS_MARKER = "@@dslaunch-agent-beats "
STACKS_MARKER = "@@dslaunch-agent-stacks "
STACKS_REQUEST = "@@dslaunch-stacks"
CHECKPOINT_REQUEST = "@@dslaunch-checkpoint"
ALIVE = "@@dslaunch-alive"
BEATS_EVERY_S = 0.5
ALIVE_EVERY_S = 1.0
CONTROLLER_SILENT_S = 10.0


def format_status_line(result: NodeResult) -> str:
    """One machine-readable line (no newline) the agent prints on stderr before exiting."""
    return STATUS_MARKER + result.to_json()


def parse_status_line(line: str | bytes) -> NodeResult | None:
    """The ``NodeResult`` carried by an agent status line, or None for any other line."""
    raw = _parse_marked(line, STATUS_MARKER)
    return _result(raw)


def format_failure_line(failure: NodeResult) -> str:
    """The line (no newline) the agent prints on stderr as soon as its first worker failed."""
    return FAILURE_MARKER + failure.to_json()


def parse_failure_line(line: str | bytes) -> NodeResult | None:
    """The first failure carried by an agent failure line, or None for any other line."""
    return _result(_parse_marked(line, FAILURE_MARKER))


def format_beats_line(beats: dict[int, Beat]) -> str:
    return BEATS_MARKER + json.dumps({str(r): b.to_dict() for r, b in beats.items()}, separators=(",", ":"))


def parse_beats_line(line: str | bytes) -> dict[int, Beat] | None:
    raw = _parse_marked(line, BEATS_MARKER)
    if not isinstance(raw, dict):
        return None
    try:
        return {int(r): Beat.from_dict(b) for r, b in raw.items()}
    except (ValueError, TypeError, KeyError):
        return None


def format_stacks_line(stacks: dict[int, dict]) -> str:
    return STACKS_MARKER + json.dumps({str(r): v for r, v in stacks.items()}, separators=(",", ":"))


def parse_stacks_line(line: str | bytes) -> dict[int, dict] | None:
    raw = _parse_marked(line, STACKS_MARKER)
    if not isinstance(raw, dict):
        return None
    try:
        return {int(r): dict(v) for r, v in raw.items()}
    except (ValueError, TypeError):
        return None


def _result(raw: Any) -> NodeResult | None:
    if not isinstance(raw, dict):
        return None
    try:
        return NodeResult.from_json(json.dumps(raw))
    except (ValueError, TypeError, KeyError):
        return None


def _parse_marked(line: str | bytes, marker: str) -> Any:
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith(marker):
        return None
    try:
        return json.loads(line[len(marker):])
    except ValueError:
        return None
