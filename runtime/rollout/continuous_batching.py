"""DeepSpeed 0.19.8's ``deepspeed.runtime.rollout.continuous_batching``: the request scheduler of a
continuous decode batch, apart from any model or cache.

A batch has ``max_batch_size`` rows (slots). Each decode step every active request makes one token;
a request retires when it has made ``max_new_tokens`` tokens or the caller says it finished (its
EOS), and pending requests, first submitted first, take the freed rows. Each transition returns a
``ContinuousBatchUpdate`` saying which old rows survive (to compact a KV cache with), which requests
retired and which were admitted (to prefill into the rows at the end).

dslaunch's ``HybridEngineRollout`` does not batch continuously (``continuous_batch_size`` is
refused); the scheduler works on its own for a script's own decode loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["ContinuousBatchRequest", "ContinuousBatchScheduler", "ContinuousBatchUpdate"]


@dataclass(frozen=True)
class ContinuousBatchRequest:
    """A request waiting for, or holding, a row of the batch."""

    request_id: Hashable


@dataclass(frozen=True)
class ContinuousBatchUpdate:
    """One transition: ``active`` is the new batch, row by row; its first ``len(keep_slots)`` rows
    are the survivors, ``keep_slots`` their rows in the previous batch (in order), and the last
    ``len(admitted)`` rows the requests admitted now."""

    active: tuple[ContinuousBatchRequest, ...]
    keep_slots: tuple[int, ...]
    retired: tuple[Hashable, ...]
    admitted: tuple[ContinuousBatchRequest, ...]

    @property
    def active_ids(self) -> tuple[Hashable, ...]:
        return tuple(request.request_id for request in self.active)

    @property
    def admitted_slots(self) -> tuple[int, ...]:
        """The rows the admitted requests are prefilled into."""
        return tuple(range(len(self.active) - len(self.admitted), len(self.active)))


class ContinuousBatchScheduler:
    """First-come slots for a bounded continuous batch; every request may make ``max_new_tokens``.

    ``schedule`` retires and admits without a decode step; ``advance`` is one decode step (every
    active request made a token), retiring those at their budget too.
    """

    def __init__(self, max_batch_size: int, max_new_tokens: int):
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive; got {max_batch_size!r}")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive; got {max_new_tokens!r}")
        self.max_batch_size = max_batch_size
        self.max_new_tokens = max_new_tokens
        self._pending: deque[ContinuousBatchRequest] = deque()
        self._rows: list[ContinuousBatchRequest] = []  # the active batch, row by row
        self._made: dict[Hashable, int] = {}  # tokens each active request made
        self._ids: set[Hashable] = set()  # pending or active

    @property
    def active(self) -> tuple[ContinuousBatchRequest, ...]:
        return tuple(self._rows)

    @property
    def pending(self) -> tuple[ContinuousBatchRequest, ...]:
        return tuple(self._pending)

    def submit(self, request: ContinuousBatchRequest) -> None:
        """Queue ``request``; its id must not be pending or active (a retired id may come back)."""
        if not isinstance(request, ContinuousBatchRequest):
            raise TypeError(f"request must be a ContinuousBatchRequest; got {type(request).__name__}")
        if request.request_id in self._ids:
            raise ValueError(f"duplicate request_id: {request.request_id!r}")
        self._ids.add(request.request_id)
        self._pending.append(request)

    def _check_active(self, finished_ids: set[Hashable]) -> None:
        stray = finished_ids - {request.request_id for request in self._rows}
        if stray:
            raise ValueError(f"finished request is not active: {next(iter(stray))!r}")

    def schedule(self, finished_ids: Iterable[Hashable] = ()) -> ContinuousBatchUpdate:
        """Retire ``finished_ids`` (active requests), then fill the free rows from the queue."""
        finished = set(finished_ids)
        self._check_active(finished)
        keep = [slot for slot, request in enumerate(self._rows) if request.request_id not in finished]
        retired = tuple(request.request_id for request in self._rows if request.request_id in finished)
        admitted = [self._pending.popleft() for _ in range(min(self.max_batch_size - len(keep), len(self._pending)))]
        self._rows = [self._rows[slot] for slot in keep] + admitted
        for request_id in retired:
            del self._made[request_id]
            self._ids.discard(request_id)
        self._made.update((request.request_id, 0) for request in admitted)
        return ContinuousBatchUpdate(tuple(self._rows), tuple(keep), retired, tuple(admitted))

    def advance(self, finished_ids: Iterable[Hashable] = ()) -> ContinuousBatchUpdate:
        """One decode step: every active request made a token; those at ``max_new_tokens`` and
        ``finished_ids`` (ended early, at their EOS) retire, then free rows are filled."""
        finished = set(finished_ids)
        self._check_active(finished)
        for request in self._rows:
            self._made[request.request_id] += 1
            if self._made[request.request_id] >= self.max_new_tokens:
                finished.add(request.request_id)
        return self.schedule(finished)
