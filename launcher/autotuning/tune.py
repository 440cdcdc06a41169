"""``dslaunch --autotuning tune``: from the user's config to the results table and the best config.

A short pipeline: the space from the ``autotuning`` block; the profiling experiment (the
space's least memory-hungry candidate: it gives the model's size and a measured baseline, unless
``model_info`` says the size); the estimator from it; the search; the results written to
``results_dir``: ``results.json`` (every candidate, run or pruned), ``summary.txt`` (the table,
also printed) and ``ds_config_optimal.json`` (the user's config with the best candidate's keys:
what ``--autotuning run`` launches with).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError, LaunchError
from dslaunch.launcher.autotuning.estimate import Estimate, ModelInfo
from dslaunch.launcher.autotuning.experiments import Experiment, ExperimentRunner, Outcome
from dslaunch.launcher.autotuning.search import SearchLimits, SearchResult, score, search
from dslaunch.launcher.autotuning.space import OFFLOADS, Candidate, apply, build_space
from dslaunch.launcher.autotuning.tuners import make_tuner
from dslaunch.runtime.config.autotuning import AutotuningConfig
from dslaunch.safe_write import explain, open_dir, write_file
from dslaunch.textfile import read_json

__all__ = ["TuneJob", "tune", "candidates", "write_results", "OPTIMAL_CONFIG"]

OPTIMAL_CONFIG = "ds_config_optimal.json"  # DeepSpeed's name in results_dir


@dataclass(frozen=True)
class TuneJob:
    """What ``tune`` needs: the user's config, the block, the ranks, the runner, the limit."""

    base: Mapping[str, Any]
    """The user's ds_config as given."""
    at: AutotuningConfig
    dp_world: int
    runner: ExperimentRunner
    memory_limit: int
    estimator: Callable[[ModelInfo], Estimate]
    """Builds the estimator from the model info (the memory estimator's seam: ``estimate.py``)."""
    exhaustive: bool = False
    """Run every candidate: no pruning, no early stop, no trial limit (a benchmark's baseline)."""


def tune(job: TuneJob, on_result: Callable[[Candidate, Outcome], None] | None = None) -> SearchResult:
    """Run the search; every experiment through ``job.runner``. Results are not written here."""
    at = job.at
    space = candidates(job)

    def config(c: Candidate) -> dict[str, Any]:
        return apply(job.base, c, job.dp_world)

    def run(c: Candidate) -> Outcome:
        return job.runner.run(Experiment(c.name, config(c)))

    if job.exhaustive:
        every = len(space)
        return search(space, make_tuner("gridsearch"), run, SearchLimits(at.metric, every, every + 1, None, False),
                      on_result=on_result)
    prior: list[tuple[Candidate, Outcome]] = []
    info, offset = _given_info(at), 0
    if info is None:
        probe = min(space, key=_least_memory)
        outcome = run(probe)
        prior.append((probe, outcome))
        if on_result is not None:
            on_result(probe, outcome)
        info = _measured_info(outcome)
        if info is not None:  # what the probe held beyond the estimate: the framework, its activations
            offset = max(0, int(outcome.metrics.get("peak_memory", 0)) - job.estimator(info)(config(probe)))
    estimate = None
    if info is not None:
        model = job.estimator(info)
        estimate = lambda c: offset + model(config(c))  # noqa: E731
    limits = SearchLimits(at.metric, at.tuner_num_trials, at.tuner_early_stopping, job.memory_limit)
    return search(space, make_tuner(at.tuner_type, at.seed), run, limits, estimate, prior,
                  on_result=on_result)


def candidates(job: TuneJob) -> list[Candidate]:
    """The space of ``job``'s config.

    Raises:
        ConfigError: the batch limits leave no micro batch.
    """
    zero = job.base.get("zero_optimization")
    # as DeepSpeed's autotuner: a stage the user's config names is the only one tuned
    stages = (int(zero["stage"]),) if isinstance(zero, Mapping) and "stage" in zero else (0, 1, 2, 3)
    space = build_space(job.at, job.dp_world, int(job.base.get("gradient_accumulation_steps") or 1), stages)
    if not space:
        raise ConfigError("leaves no micro batch to try: min_train_micro_batch_size_per_gpu, "
                          "max_train_micro_batch_size_per_gpu and max_train_batch_size exclude every size",
                          key="autotuning")
    return space


def _least_memory(c: Candidate) -> tuple:
    return (-c.stage, -OFFLOADS.index(c.offload or "none"), not c.checkpointing, c.micro_batch, c.gas)


MODEL_INFO_MAX_BYTES = 2**20
"""``model_info_path``: DeepSpeed's model_info.json holds a few numbers."""


def _given_info(at: AutotuningConfig) -> ModelInfo | None:
    """The model's size from ``model_info`` or ``model_info_path``, else None (to be measured)."""
    info = dict(at.model_info or {})
    if at.model_info_path is not None and "num_params" not in info:
        def fail(message: str, line: int | None) -> ConfigError:
            where = f"{at.model_info_path}{f':{line}' if line else ''}"
            return ConfigError(f"{where}: {message}", key="autotuning.model_info_path")

        info = read_json(at.model_info_path, MODEL_INFO_MAX_BYTES, fail)
        if not isinstance(info, dict):
            raise fail('expected a JSON object such as {"num_params": 124439808}', None)
    return ModelInfo(int(info["num_params"])) if info.get("num_params") else None


def _measured_info(outcome: Outcome) -> ModelInfo | None:
    """The model info the profiling experiment measured (None when it failed)."""
    m = outcome.metrics
    if outcome.status != "ok" or not m.get("num_params"):
        return None
    return ModelInfo(int(m["num_params"]), int(m.get("largest_layer", 0)))


def write_results(results_dir: str, result: SearchResult, job: TuneJob) -> str | None:
    """Write ``results.json``, ``summary.txt`` and (when something was measured) the best config
    by ``safe_write``'s rule (each replaced whole, never written through a link); returns the best
    config's path, or None.

    Raises:
        LaunchError: ``results_dir`` or a file there cannot be written safely; names it.
    """
    runs = [json.loads(o.to_json()) | {"ds_config": apply(job.base, c, job.dp_world)} for c, o in result.runs]
    files = {"results.json": json.dumps(runs, indent=1), "summary.txt": table(result, job.at.metric) + "\n"}
    if result.best is not None:
        best = apply(job.base, result.best, job.dp_world)
        best.get("autotuning", {}).pop("metric_path", None)
        files[OPTIMAL_CONFIG] = json.dumps(best, indent=2)
    try:
        dir_fd = open_dir(results_dir)
        try:
            for name, text in files.items():
                write_file(dir_fd, name, text)
        finally:
            os.close(dir_fd)
    except OSError as err:
        raise LaunchError(f"autotuning: cannot write the results: {explain(err, results_dir)}") from None
    return os.path.join(results_dir, OPTIMAL_CONFIG) if result.best is not None else None


def table(result: SearchResult, metric: str) -> str:
    """The results, one row per candidate: the best first, then the measured by score, then the rest."""
    def key(item: tuple[Candidate, Outcome]) -> tuple:
        c, o = item
        s = score(metric, o.metrics) if o.status == "ok" else None
        return (c != result.best, s is None, -(s or 0.0))

    header = f"{'experiment':<42} {'status':<9} {metric:>12} {'peak MiB':>9} {'est MiB':>8} {'s':>6}  note"
    rows = [header, "-" * len(header)]
    for c, o in sorted(result.runs, key=key):
        s = score(metric, o.metrics) if o.status == "ok" else None
        value = (1.0 / s if metric == "latency" else s) if s else None
        rows.append(f"{c.name:<42} {o.status:<9} {_num(value):>12} {_mib(o.metrics.get('peak_memory')):>9} "
                    f"{_mib(o.estimate):>8} {o.seconds:>6.1f}  {o.message[:80]}")
    rows.append(f"{result.experiments} experiments run, {len(result.runs) - result.experiments} pruned; "
                f"best: {result.best.name if result.best else 'none'}")
    return "\n".join(rows)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _mib(x: Any) -> str:
    return "-" if not x else f"{int(x) / 2**20:.0f}"
