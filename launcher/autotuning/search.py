"""The search: prune by memory, ask the tuner, run, record, stop.

``search`` owns the rules every tuner shares: a candidate the estimator puts above the memory
limit is never run (``pruned``); once two micro batches of a checkpointing setting were measured,
the activations fitted to their peaks (``estimate.ActivationFit``) are added to the estimate and
open candidates above the limit by more than ``ACTIVATION_MARGIN`` are pruned too; an
experiment that ran out of memory rules out every open
candidate that needs at least as much (``space.dominates``, or by the estimator: the same
checkpointing, a micro batch as large and model states estimated as large); a failed, hung or timed-out
experiment is recorded and the search goes on; the search stops after ``tuner_num_trials``
experiments, after ``tuner_early_stopping`` experiments in a row without a better score (out of
memory ones and those of the tuner's exploration not counted), or when nothing is left. The tuner (``tuners.py``) only picks the next candidate; the runner
(``experiments.py``) only runs one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dslaunch.launcher.autotuning.estimate import ActivationFit
from dslaunch.launcher.autotuning.experiments import Outcome
from dslaunch.launcher.autotuning.space import Candidate, dominates
from dslaunch.launcher.autotuning.tuners import Tuner

__all__ = ["SearchLimits", "SearchResult", "search", "score", "ACTIVATION_MARGIN"]

ACTIVATION_MARGIN = 0.02
"""A fitted prediction must pass the limit by this fraction of it to prune: a peak measured on a
shared host moves by about that much between runs, and a candidate just under the limit is
where the best usually is."""


def score(metric: str, metrics: Mapping[str, Any]) -> float | None:
    """Higher is better: throughput (samples/s), flops (FLOPS_per_gpu) or 1/latency (per step)."""
    if metric == "latency":
        latency = metrics.get("latency")
        return 1.0 / latency if latency else None
    value = metrics.get("FLOPS_per_gpu" if metric == "flops" else "throughput")
    return float(value) if value is not None else None


@dataclass(frozen=True)
class SearchLimits:
    metric: str = "throughput"
    num_trials: int = 50
    early_stopping: int = 5
    memory_limit: int | None = None
    """Bytes per rank; None: no pruning by the estimator."""
    prune_after_oom: bool = True
    """False: run every candidate even after a smaller one ran out of memory (the exhaustive grid
    a benchmark compares with)."""


@dataclass(frozen=True)
class SearchResult:
    runs: tuple[tuple[Candidate, Outcome], ...]
    """Every candidate in the order it was decided: run, or pruned."""
    best: Candidate | None

    @property
    def experiments(self) -> int:
        """Experiments actually run (pruned candidates cost nothing)."""
        return sum(1 for _, o in self.runs if o.status != "pruned")

    def outcome(self, c: Candidate) -> Outcome | None:
        return next((o for d, o in self.runs if d == c), None)


def search(space: Sequence[Candidate], tuner: Tuner, run: Callable[[Candidate], Outcome],
           limits: SearchLimits, estimate: Callable[[Candidate], int] | None = None,
           prior: Sequence[tuple[Candidate, Outcome]] = (),
           on_result: Callable[[Candidate, Outcome], None] | None = None) -> SearchResult:
    """Search ``space`` with ``tuner``; ``run`` runs one candidate's experiment.

    Args:
        estimate: a candidate's estimated bytes per rank (see ``estimate.Estimate``), or None.
        prior: experiments already run (the profiling one): they count as the first results.
        on_result: called after each decision (the CLI prints a line), not for ``prior``.
    """
    decided: list[tuple[Candidate, Outcome]] = []
    scores: dict[Candidate, float | None] = {}
    open_ = list(space)

    def record(c: Candidate, o: Outcome, report: bool = True) -> None:
        decided.append((c, o))
        if c in open_:
            open_.remove(c)
        if on_result is not None and report:
            on_result(c, o)

    if estimate is not None and limits.memory_limit is not None:
        ran = {c for c, _ in prior}
        for c in [c for c in open_ if c not in ran]:
            need = estimate(c)
            if need > limits.memory_limit:
                record(c, Outcome(c.name, "pruned", {}, f"estimated {need / 2**20:.0f} MiB per rank, above the "
                                  f"limit {limits.memory_limit / 2**20:.0f} MiB", estimate=need))
    fit = ActivationFit()

    def prune_by_activations(c: Candidate, o: Outcome) -> None:
        """Learn from ``c``'s peak; prune the open candidates its setting's fit puts above the limit."""
        peak = o.metrics.get("peak_memory")
        if estimate is None or limits.memory_limit is None or o.status != "ok" or not peak:
            return
        fit.add(c.checkpointing, c.micro_batch, float(peak) - estimate(c))
        line = fit.slope(c.checkpointing)
        if line is None:
            return
        for d in [d for d in open_ if d.checkpointing == c.checkpointing]:
            states, acts = estimate(d), fit.predict(d.checkpointing, d.micro_batch) or 0.0
            if states + acts > limits.memory_limit * (1 + ACTIVATION_MARGIN):
                record(d, Outcome(d.name, "pruned", {}, f"estimated {(states + acts) / 2**20:.0f} MiB per rank "
                                  f"(activations fitted to measured peaks: {line[1] / 2**10:.1f} KiB per sample), "
                                  f"above the limit {limits.memory_limit / 2**20:.0f} MiB", estimate=int(states + acts)))

    best: tuple[float, Candidate] | None = None
    stale = 0
    done = list(prior)
    while (done or open_) and len(scores) < limits.num_trials and stale < limits.early_stopping:
        ran_before = bool(done)
        if done:
            c, outcome = done.pop(0)
        else:
            c = tuner.next(open_, scores)
            outcome = run(c)
        if estimate is not None:
            outcome = replace(outcome, estimate=estimate(c))
        record(c, outcome, report=not ran_before)
        s = score(limits.metric, outcome.metrics) if outcome.status == "ok" else None
        scores[c] = s
        if s is not None and (best is None or s > best[0]):
            best, stale = (s, c), 0
        elif best is not None and outcome.status != "oom" and not tuner.exploring(open_, scores):
            # no early stop before anything was measured; an OOM does not count either: it marks
            # the memory frontier (where the best usually is) and prunes what lies beyond it
            stale += 1
        prune_by_activations(c, outcome)
        if outcome.status == "oom" and limits.prune_after_oom:
            for d in [d for d in open_ if dominates(c, d) or _estimated_above(estimate, c, d)]:
                record(d, Outcome(d.name, "pruned", {}, f"needs at least the memory of {c.name}, "
                                  "which ran out of memory"))
    return SearchResult(tuple(decided), best[1] if best else None)


def _estimated_above(estimate: Callable[[Candidate], int] | None, oom: Candidate, d: Candidate) -> bool:
    """Whether ``d`` needs at least what ``oom`` (out of memory) needed by the estimator: the same
    checkpointing, a micro batch as large, model states estimated as large. The estimator orders
    stages and offloads where ``dominates``'s fixed order cannot (stage 3 with the default
    ``stage3_max_live_parameters`` keeps a small model whole, so it holds more than stage 2)."""
    return (estimate is not None and d.checkpointing == oom.checkpointing and d.micro_batch >= oom.micro_batch
            and estimate(d) >= estimate(oom))
