"""Search strategies (``tuner_type``): which candidate to try next, given the results so far.

A tuner only chooses; ``search.py`` runs the experiments, prunes and stops. Each ``next`` gets
the candidates still open (not tried, not pruned) and the scores so far (``None`` for an
experiment that failed), higher is better, and returns one of the open candidates.

- ``gridsearch``: the space in order (stage, offload, checkpointing, micro batch, ...).
- ``random``: a seeded random order.
- ``model_based``: first a few candidates that together cover every value of every axis (among
  those that show as many new values, the one the cost model predicts best once two results
  fit it, else one at random), then the open candidate the model predicts best: a ridge regression of the log score on the
  axes (one-hot for the categorical ones, log2 for sizes), refitted after each result. When the
  model says larger micro batches are faster, it chooses only among each family's largest micro
  batch still open (``_frontier``): the additive model cannot know where memory runs out, and
  the out-of-memory rule moves a family's frontier down.
  Multiplicative effects (ZeRO's communication, offload's copies, checkpointing's recompute,
  the batch's efficiency) are additive in the log, so few results fit the space well.
  DeepSpeed's model_based tuner fits XGBoost on the same kind of features; this one needs no
  package.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import replace

from dslaunch.launcher.autotuning.space import Candidate, axes

__all__ = ["Tuner", "GridSearch", "RandomSearch", "ModelBased", "TUNERS", "make_tuner"]


class Tuner(ABC):
    """Picks the next experiment."""

    @abstractmethod
    def next(self, open_: Sequence[Candidate], scores: Mapping[Candidate, float | None]) -> Candidate:
        """One of ``open_`` (never empty); ``scores``: every result so far (None: it failed)."""

    def exploring(self, open_: Sequence[Candidate], scores: Mapping[Candidate, float | None]) -> bool:
        """Whether the tuner is still sampling to learn, not yet choosing by what it learnt: the
        search does not stop early then."""
        return False


class GridSearch(Tuner):
    def next(self, open_: Sequence[Candidate], scores: Mapping[Candidate, float | None]) -> Candidate:
        return open_[0]


class RandomSearch(Tuner):
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def next(self, open_: Sequence[Candidate], scores: Mapping[Candidate, float | None]) -> Candidate:
        return self._rng.choice(list(open_))


class ModelBased(Tuner):
    """A cover of the axes' values first, then the cost model's best prediction."""

    def __init__(self, seed: int = 0, ridge: float = 0.1) -> None:
        self._rng = random.Random(seed)
        self._ridge = ridge

    def exploring(self, open_: Sequence[Candidate], scores: Mapping[Candidate, float | None]) -> bool:
        return bool(_uncovered(open_, scores))

    def next(self, open_: Sequence[Candidate], scores: Mapping[Candidate, float | None]) -> Candidate:
        good = {c: s for c, s in scores.items() if s is not None and s > 0}
        model = _fit(good, self._ridge) if len(good) >= 2 else None
        uncovered = _uncovered(open_, scores)
        if uncovered:
            # the open candidate that shows the most values not yet seen; among those, the one the
            # model predicts best once there is one (exploring where it may pay), else at random
            gain = {c: len(set(axes(c)) & uncovered) for c in open_}
            best = max(gain.values())
            if best > 0:
                showing = [c for c in open_ if gain[c] == best]
                if model is None:
                    return self._rng.choice(showing)
                return max(showing, key=lambda c: (model(c), c.micro_batch))
        if model is None:
            return self._rng.choice(list(open_))
        probe = open_[0]
        if model(replace(probe, micro_batch=2 * probe.micro_batch)) > model(probe):
            open_ = _frontier(open_)  # a larger micro batch pays: each family's largest one left first
        return max(open_, key=lambda c: (model(c), c.micro_batch))


def _frontier(open_: Sequence[Candidate]) -> list[Candidate]:
    """The open candidates with the largest micro batch still open in their family (all axes but
    the micro batch): where a family's best is when larger batches are faster, as long as it fits
    (the search prunes what lies beyond an out-of-memory one)."""
    top: dict[Candidate, int] = {}
    for c in open_:
        family = replace(c, micro_batch=0)
        top[family] = max(top.get(family, 0), c.micro_batch)
    return [c for c in open_ if c.micro_batch == top[replace(c, micro_batch=0)]]


def _uncovered(open_: Sequence[Candidate], scores: Mapping[Candidate, float | None]) -> set[tuple]:
    """Axis values that open candidates have and no measured candidate showed yet."""
    seen = {v for c, s in scores.items() if s is not None for v in axes(c)}
    return {v for c in open_ for v in axes(c)} - seen


def _features(c: Candidate, columns: Sequence[tuple]) -> list[float]:
    """1 (intercept), then per column: a categorical value's indicator or a size's log2."""
    values = dict(axes(c))
    row = [1.0]
    for name, value in columns:
        if value == "log2":
            row.append(math.log2(values[name]))
        else:
            row.append(1.0 if values[name] == value else 0.0)
    return row


_SIZES = ("micro_batch", "gas", "reduce_bucket_size")


def _columns(cands: Sequence[Candidate]) -> list[tuple]:
    """One column per size axis that varies (log2) and per categorical value beyond the first."""
    cols: list[tuple] = []
    names = [name for name, _ in axes(cands[0])]
    for name in names:
        values = sorted({dict(axes(c))[name] for c in cands}, key=repr)
        if len(values) < 2:
            continue
        if name in _SIZES and None not in values:
            cols.append((name, "log2"))
        else:
            cols.extend((name, v) for v in values[1:])
    return cols


def _fit(scores: Mapping[Candidate, float], ridge: float):  # type: ignore[no-untyped-def]
    """The ridge regression of log(score) on the features: a predictor of log score."""
    cands = list(scores)
    cols = _columns(cands)
    rows = [_features(c, cols) for c in cands]
    y = [math.log(scores[c]) for c in cands]
    n = len(rows[0])
    # normal equations (X'X + ridge*I) w = X'y; the intercept is not penalised
    a = [[sum(r[i] * r[j] for r in rows) + (ridge if i == j and i else 0.0) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * t for r, t in zip(rows, y, strict=True)) for i in range(n)]
    w = _solve(a, b)
    return lambda c: sum(wi * xi for wi, xi in zip(w, _features(c, cols), strict=True))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a few dozen unknowns at most)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-12:
            continue  # a column no data pins down: its weight stays 0
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0 for i in range(n)]


TUNERS = {"gridsearch": lambda seed: GridSearch(), "random": RandomSearch, "model_based": ModelBased}
"""``tuner_type`` -> a factory taking the seed."""


def make_tuner(name: str, seed: int = 0) -> Tuner:
    return TUNERS[name](seed)
