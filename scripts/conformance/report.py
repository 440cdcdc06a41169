"""Outcomes of a conformance run, per area and side, and the share of DeepSpeed's passes kept.

The input is the events file that ``shim/conformance_shim.py`` writes for each side (JSON lines:
``collected``, ``collect_error``, ``file``, ``report``). A test DeepSpeed ran that dslaunch never
collected (its file failed to import) counts as a dslaunch failure: a name a test needs is missing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

OUTCOMES = ("passed", "failed", "skipped")
_RANK = {"passed": 0, "skipped": 1, "failed": 2}


@dataclass(frozen=True)
class Result:
    outcome: str  # one of OUTCOMES
    reason: str = ""


@dataclass
class SideRun:
    """One side's results: test id -> Result, and each file that failed to load, with why."""

    results: dict[str, Result] = field(default_factory=dict)
    collect_errors: dict[str, str] = field(default_factory=dict)


def read_events(path: Path, unfinished_reason: str = "") -> SideRun:
    """Reads an events file. A collected test with no report failed with ``unfinished_reason``
    (its pytest process was killed or exited early); with no reason given it is left out."""
    run = SideRun()
    collected: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        kind = event["event"]
        if kind == "collected":
            collected.append(event["nodeid"])
        elif kind == "collect_error":
            run.collect_errors[event["nodeid"]] = event.get("reason", "")
        elif kind == "report":
            merge(run, event["nodeid"], Result(event["outcome"], event.get("reason", "")))
    if unfinished_reason:
        for nodeid in collected:
            run.results.setdefault(nodeid, Result("failed", unfinished_reason))
    return run


def merge(run: SideRun, nodeid: str, result: Result) -> None:
    """Keeps the worse of two reports for one test (a teardown error fails a passed test)."""
    old = run.results.get(nodeid)
    if old is None or _RANK[result.outcome] > _RANK[old.outcome]:
        run.results[nodeid] = result


def replace_files(old: SideRun, new: SideRun, files: list[str], complete: bool = True) -> SideRun:
    """``old`` with the outcomes of ``files`` replaced by ``new``'s (a run of some files). When the
    run was not ``complete`` (some tests of the files left out), ``old``'s other tests of them stay."""
    ran = set(files) if complete else set()
    merged = SideRun({n: r for n, r in old.results.items() if file_of(n) not in ran},
                     {p: why for p, why in old.collect_errors.items() if p not in ran})
    merged.results.update(new.results)
    merged.collect_errors.update(new.collect_errors)
    return merged


def save(run: SideRun, path: Path) -> None:
    path.write_text(json.dumps({"results": {n: vars(r) for n, r in sorted(run.results.items())},
                                "collect_errors": run.collect_errors}, indent=1) + "\n")


def load(path: Path) -> SideRun:
    data = json.loads(path.read_text())
    return SideRun({n: Result(**r) for n, r in data["results"].items()}, data["collect_errors"])


def load_recorded(results: Path, side: str) -> SideRun:
    """One side's outcomes as a results file (``conformance.json``) records them; empty if absent."""
    if not results.exists():
        return SideRun()
    data = json.loads(results.read_text())
    return SideRun({n: Result(**r) for n, r in data["tests"].get(side, {}).items()},
                   data.get("collect_errors", {}).get(side, {}))


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def outcome_on(reference: SideRun, other: SideRun, nodeid: str) -> Result:
    """The other side's result for a test the reference side ran; not collected = failed."""
    if nodeid in other.results:
        return other.results[nodeid]
    path = file_of(nodeid)
    why = other.collect_errors.get(path, "not collected")
    return Result("failed", f"not loaded: {why}")


@dataclass(frozen=True)
class AreaRow:
    area: str
    deepspeed: dict[str, int]
    dslaunch: dict[str, int]
    kept: int  # tests DeepSpeed passes that dslaunch passes too


def area_rows(areas: dict[str, list[str]], deepspeed: SideRun, dslaunch: SideRun) -> list[AreaRow]:
    """Counts per area. Tests are DeepSpeed's: the dslaunch column counts the same test ids,
    plus any test only dslaunch collected (a parametrisation that differs)."""
    rows = []
    for area, files in areas.items():
        in_area = set(files)
        ds_ids = [n for n in deepspeed.results if file_of(n) in in_area]
        ds_ids += [f"{p}::<collect>" for p in deepspeed.collect_errors if p in in_area]
        own_ids = [n for n in dslaunch.results if file_of(n) in in_area and n not in deepspeed.results]
        ds_counts = _count(deepspeed.results.get(n, Result("failed")) for n in ds_ids)
        dl_counts = _count([outcome_on(deepspeed, dslaunch, n) for n in ds_ids] + [dslaunch.results[n] for n in own_ids])
        kept = sum(
            1
            for n in ds_ids
            if deepspeed.results.get(n, Result("failed")).outcome == "passed"
            and outcome_on(deepspeed, dslaunch, n).outcome == "passed"
        )
        rows.append(AreaRow(area, ds_counts, dl_counts, kept))
    return rows


def _count(results) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for result in results:
        counts[result.outcome] += 1
    return counts


def share_kept(rows: list[AreaRow]) -> tuple[int, int, float]:
    """(kept, DeepSpeed passed, percent) over all areas; 0 passed gives 0.0."""
    kept = sum(r.kept for r in rows)
    passed = sum(r.deepspeed["passed"] for r in rows)
    return kept, passed, (100.0 * kept / passed if passed else 0.0)


def table(rows: list[AreaRow]) -> str:
    """The per-area table: DeepSpeed's passed/failed/skipped, dslaunch's, and the kept count."""
    head = f"{'area':<26} {'DeepSpeed p/f/s':>16} {'dslaunch p/f/s':>16} {'kept':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ds = "/".join(str(r.deepspeed[o]) for o in OUTCOMES)
        dl = "/".join(str(r.dslaunch[o]) for o in OUTCOMES)
        lines.append(f"{r.area:<26} {ds:>16} {dl:>16} {r.kept:>4}/{r.deepspeed['passed']:<4}")
    kept, passed, percent = share_kept(rows)
    lines.append("-" * len(head))
    lines.append(f"dslaunch passes {kept} of the {passed} tests DeepSpeed passes: {percent:.1f}%")
    return "\n".join(lines)


_LISTED = re.compile(r"^\|\s*`([^`]+)`")


def expected_failures(path: Path) -> set[str]:
    """Test ids listed in EXPECTED_FAILURES.md (a table whose first cell is the id in backticks)."""
    if not path.exists():
        return set()
    return {m.group(1) for line in path.read_text(encoding="utf-8").splitlines() if (m := _LISTED.match(line))}


def regressions(deepspeed: SideRun, dslaunch: SideRun) -> dict[str, Result]:
    """Tests DeepSpeed passes and dslaunch does not, with dslaunch's reason."""
    lost = {}
    for nodeid, result in deepspeed.results.items():
        if result.outcome == "passed":
            other = outcome_on(deepspeed, dslaunch, nodeid)
            if other.outcome != "passed":
                lost[nodeid] = other
    return lost
