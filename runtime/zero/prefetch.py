"""Stage 3's memory of the order parameters are used in, and what it buys: prefetch and reuse.

An iteration (one forward and its backward, or one forward without grad) is a sequence of fetch
events: a module's forward pre-hook (the parameters it uses) or backward unpacking a saved
parameter. ``Trace`` is one recorded iteration. ``LiveParams`` is the set of whole parameters the
fetcher made (or is making) whole, oldest use first, and applies DeepSpeed's three knobs
(``FetchLimits``, in elements):

- ``prefetch_numel`` (``stage3_prefetch_bucket_size``): while event k runs, the gathers of the
  parameters of the events after it are in flight, up to this many elements reserved ahead of use
  (0: no prefetch). Only on a replayed trace: the first iteration of each mode records.
- ``max_live`` (``stage3_max_live_parameters``): before gathering more, the least recently used
  whole parameters that no running module, pending backward or reserved prefetch needs are
  released until the whole ones plus the new ones fit. A prefetch that does not fit is not made.
  The parameters a running module needs are gathered even past the limit (there is no other
  way to run it); DeepSpeed bounds only its prefetch by this number.
- ``max_reuse`` (``stage3_max_reuse_distance``): a parameter whose next use in the trace comes
  within this many elements (counted over the events in between, as DeepSpeed counts) is kept
  whole instead of being released and gathered again.

Limitations: an iteration whose events differ from the trace (a data-dependent branch) falls back
to gathering on demand from the first difference; the next iteration records again.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass

import torch

from dslaunch.runtime.zero import params as zp

__all__ = ["FetchLimits", "Event", "Trace", "LiveParams"]


@dataclass(frozen=True)
class FetchLimits:
    """Stage 3's prefetch and live-parameter limits, in elements (DeepSpeed's defaults)."""

    prefetch_numel: int = 50_000_000
    max_live: int = 1_000_000_000
    max_reuse: int = 1_000_000_000


@dataclass(frozen=True)
class Event:
    """One fetch: ``key`` names it (("f", module id) or ("b", parameter ds_id)), ``params`` it needs."""

    key: tuple
    params: tuple[torch.nn.Parameter, ...]


class Trace:
    """A recorded iteration: its events, where each starts in elements, where each parameter is used."""

    def __init__(self, events: list[Event]):
        self.events = tuple(events)
        self.start = [0]
        self._uses: dict[int, list[int]] = {}
        for i, ev in enumerate(self.events):
            self.start.append(self.start[-1] + sum(p.ds_numel for p in ev.params))
            for p in ev.params:
                self._uses.setdefault(id(p), []).append(i)

    def distance(self, p: torch.nn.Parameter, cursor: int) -> int | None:
        """Elements of the events from ``cursor`` up to ``p``'s next use (None: not used again)."""
        uses = self._uses.get(id(p), [])
        i = bisect.bisect_left(uses, cursor)
        return None if i == len(uses) else self.start[uses[i]] - self.start[cursor]


def _numel(params: list[torch.nn.Parameter]) -> int:
    return sum(p.ds_numel for p in params)


class LiveParams:
    """The parameters the fetcher made whole or is gathering, least recently used first.

    ``busy`` holds the ids of parameters backward unpacked and whose gradient is not taken yet
    (they must stay whole); ``reserved`` maps a prefetched (or already whole) parameter to the last
    trace event the prefetch walked it for.
    """

    def __init__(self, limits: FetchLimits):
        self.limits = limits
        self._live: OrderedDict[int, torch.nn.Parameter] = OrderedDict()
        self.busy: set[int] = set()
        self.reserved: dict[int, tuple[torch.nn.Parameter, int]] = {}
        self.ahead = 0  # the next trace event the prefetch walk has not reached
        # elements of ``_live``, kept as it changes (one recount per iteration: a parameter released
        # by someone else, ``GatheredParameters``, leaves it an overestimate until then)
        self._numel = 0

    def numel(self) -> int:
        """Elements whole or being gathered (what ``max_live`` bounds)."""
        return self._numel

    def in_use(self, p: torch.nn.Parameter) -> bool:
        return p._dsl_users > 0 or id(p) in self.busy

    def _track(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            if zp.is_partitioned(p) and not p.ds_persist:
                if id(p) not in self._live:
                    self._numel += p.ds_numel
                self._live[id(p)] = p
                self._live.move_to_end(id(p))

    def _drop(self, key: int) -> None:
        self._numel -= self._live.pop(key).ds_numel

    def _make_room(self, numel: int, spare: set[int]) -> bool:
        """Release least recently used parameters not in use (nor in ``spare``) until ``numel``
        more elements fit under ``max_live``. Local (no communication)."""
        if self._numel + numel <= self.limits.max_live:
            return True
        for key, p in list(self._live.items()):
            if self._numel + numel <= self.limits.max_live:
                break
            if p.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE:  # released by someone else
                self._drop(key)
                continue
            if self.in_use(p) or key in spare:
                continue
            zp.fetch([p])  # an unused prefetch still in flight: only waits for it, to free it
            self.reserved.pop(key, None)
            zp.release([p])
            self._drop(key)
        return self._numel + numel <= self.limits.max_live

    def fetch(self, params: list[torch.nn.Parameter]) -> None:
        """Make ``params`` whole now (collective for those not available), room made first."""
        missing = [p for p in params if zp.is_partitioned(p) and p.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE]
        self._make_room(_numel(missing), {id(p) for p in params})
        zp.fetch(params)
        self._track(params)

    def consume(self, index: int) -> None:
        """Trace event ``index`` is running: its reservations are used up."""
        for key in [k for k, (_, last) in self.reserved.items() if last <= index]:
            del self.reserved[key]

    def prefetch(self, trace: Trace, cursor: int) -> None:
        """Start gathering the parameters of the events from ``cursor`` on, while the reserved
        elements stay within ``prefetch_numel`` and the whole ones within ``max_live``.

        collective: every rank walks the same trace with the same state.
        """
        self.ahead = max(self.ahead, cursor)
        held = _numel([p for p, _ in self.reserved.values()])
        while self.ahead < len(trace.events):
            ev = trace.events[self.ahead]
            new = list({id(p): p for p in ev.params if id(p) not in self.reserved}.values())
            if held + _numel(new) > self.limits.prefetch_numel:
                break
            todo = [p for p in new if p.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE]
            if not self._make_room(_numel(todo), set(self.reserved) | {id(p) for p in ev.params}):
                break
            for p in ev.params:
                self.reserved[id(p)] = (p, self.ahead)
            held += _numel(new)
            self._track(zp.start_fetch(todo))
            self.ahead += 1

    def keep(self, p: torch.nn.Parameter, trace: Trace | None, cursor: int) -> bool:
        """Whether ``p``, no longer used now, stays whole: reserved by the prefetch, or used again
        within ``max_reuse`` elements of the trace."""
        if id(p) in self.reserved:
            return True
        distance = trace.distance(p, cursor) if trace is not None else None
        return distance is not None and distance < self.limits.max_reuse

    def release(self, params: list[torch.nn.Parameter], trace: Trace | None, cursor: int) -> None:
        """Release those of ``params`` nobody uses and ``keep`` does not keep."""
        for p in params:
            if not self.in_use(p) and not self.keep(p, trace, cursor):
                zp.release([p])
                if id(p) in self._live:
                    self._drop(id(p))

    def release_all(self, params: list[torch.nn.Parameter]) -> None:
        """End of an iteration: finish what is in flight, forget reservations, release every
        parameter of ``params`` (and every one this set made whole) that no forward holds."""
        everything = list(self._live.values()) + params
        zp.fetch([p for p in everything if p.ds_status is zp.ZeroParamStatus.INFLIGHT])
        self.busy.clear()
        self.reserved.clear()
        self.ahead = 0
        zp.release(everything)
        self._live = OrderedDict((k, p) for k, p in self._live.items()
                                 if p.ds_status is not zp.ZeroParamStatus.NOT_AVAILABLE)
        self._numel = _numel(list(self._live.values()))
