"""scripts/bench/pipeline_bench.py split over calls (``--only``): a call keeps the configurations
and calls of the results file it did not run, only when they were measured the same way."""

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "scripts" / "bench"


@pytest.mark.timeout(30)
def test_a_split_run_keeps_the_other_calls_configurations(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("pipeline_bench", None)
    import pipeline_bench

    path = tmp_path / "pipeline_bench_200ms.json"
    call = {"only": ["dslaunch-1f1b"], "load_before": [1.0, 1.0, 1.0], "load_after": [0.5, 0.5, 0.5],
            "start": "2026-11-27 18:40 UTC"}
    meta = {"steps": 5, "warmup": 1, "forward_ms": 200.0, "calls": [call]}
    ours = {"step_ms": 6674.0, "bubble": 0.2791, "formula": 0.2727, "off_points": 0.64}
    results = {"dslaunch-1f1b": ours, "torch-1f1b": {**ours, "bubble": 0.27}}
    path.write_text(json.dumps({"meta": meta, "results": results}))

    def args(**kw) -> argparse.Namespace:
        given = {"steps": 5, "warmup": 1, "forward_ms": 200.0, "only": ["torch-1f1b"], **kw}
        return argparse.Namespace(**given)

    kept_meta, kept = pipeline_bench._earlier(path, args())
    assert kept == {"dslaunch-1f1b": ours} and kept_meta["calls"] == [call]
    assert pipeline_bench._earlier(path, args(steps=8)) == ({}, {})  # measured otherwise: start afresh
    assert pipeline_bench._earlier(tmp_path / "none.json", args()) == ({}, {})
    listed = "- 2026-11-27 18:40 UTC, dslaunch-1f1b: [1.0, 1.0, 1.0] / [0.5, 0.5, 0.5]"
    assert listed in pipeline_bench._markdown(kept, kept_meta)
