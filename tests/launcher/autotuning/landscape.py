"""A synthetic search landscape for the tuner tests: throughput and memory of a candidate, shaped
like a real model's on a few ranks (bigger micro batches are faster but need activation memory;
each ZeRO stage costs communication and saves model states; offload and checkpointing cost time
and save memory), with each experiment's outcome decided from it."""

from __future__ import annotations

import math

from dslaunch.launcher.autotuning.experiments import Outcome
from dslaunch.launcher.autotuning.space import Candidate

LIMIT = 1000


def states(c: Candidate) -> float:
    """The framework's and the model states' memory: what the estimator knows."""
    return 100 + 600 / (1, 2, 3, 4)[c.stage] * (0.5 if c.offload in ("optimizer", "all") else 1.0) * (
        0.7 if c.offload == "all" else 1.0)


def memory(c: Candidate) -> float:
    return states(c) + 25 * c.micro_batch * (0.3 if c.checkpointing else 1.0)


def throughput(c: Candidate) -> float:
    batch = 1000 * c.micro_batch / (c.micro_batch + 8)  # diminishing returns
    return (batch * (1.0, 0.97, 0.9, 0.7)[c.stage] * {None: 1, "none": 1, "optimizer": 0.6, "all": 0.45}[c.offload]
            * (0.75 if c.checkpointing else 1.0) * (1.02 if c.gas > 1 else 1.0))


def outcome(c: Candidate) -> Outcome:
    if memory(c) > LIMIT:
        return Outcome(c.name, "oom", {}, "out of memory")
    return Outcome(c.name, "ok", {"throughput": throughput(c), "latency": c.micro_batch / throughput(c),
                                  "peak_memory": memory(c)})


def best_feasible(space: list[Candidate]) -> float:
    return max((throughput(c) for c in space if memory(c) <= LIMIT), default=math.nan)
