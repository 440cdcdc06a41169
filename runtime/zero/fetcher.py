"""When stage 3 gathers and releases parameters: around each module's forward, and in backward.

Forward: a pre-hook on every submodule gathers its own partitioned parameters (and those
``register_external_parameter`` attached to it; all of a leaf module's, see below) and a forward
hook (also called when forward raises) releases them (unless prefetch or reuse keeps them, below).
Nested and repeated calls are counted per parameter (``_dsl_users``), so a shared (tied)
parameter or a module called twice works.

Backward: while a hooked forward runs, autograd's saved-tensor hooks replace every partitioned
parameter (or view of one) saved for backward by a reference; when backward unpacks it the
parameter is gathered again. It is released after its gradient was taken (the gradient path's
post-accumulate hook runs first) or, at the latest, by ``release_idle`` after backward. So
backward needs no module hooks and works for any module output type. Under ``torch.no_grad()``
nothing is saved: evaluation costs one gather per module. Activation checkpointing (reentrant or
not) recomputes forwards during backward: there the hooks gather as usual but leave the saved
tensors to the checkpoint and keep the parameters whole until their gradients are taken.

Custom autograd Functions: with any saved-tensor hook active torch hands a Function's backward
plain tensors from ``ctx.saved_tensors``, never the saved Parameter, so its ``ds_*`` attributes are
gone (TRL's chunked log-prob saves ``lm_head.weight`` and reads ``ds_status`` in backward, as
DeepSpeed allows). While a hooked forward runs, ``Function.apply`` is wrapped: with this fetcher's
hooks on top of torch's stack a Function saves without them (its Parameters are saved as
themselves), and a pre-hook on its backward node gathers the partitioned Parameters it saved, so
its backward sees them whole (``ds_status`` AVAILABLE), as the saved-tensor path would. Tensors it
saves that are views of a partitioned Parameter keep the gathered storage alive until backward.

Prefetch and reuse (``prefetch.py``): every gather above is a fetch event; the first iteration
in each mode (``module.training`` x grad enabled) records them, later ones replay the record and,
while event k runs, have the gathers of the next events in flight (``stage3_prefetch_bucket_size``
elements ahead; the event that needs them waits), keep parameters reused soon
(``stage3_max_reuse_distance``) and bound the whole ones (``stage3_max_live_parameters``). An event
that differs from the record drops it: on demand for the rest of the iteration, recorded again in
the next. An iteration ends after backward (``release_idle``), at the end of a forward without
grad, or when the next outermost forward starts; everything not held is released then.

Leaf modules: a module whose forward reads its children's parameters without calling them
(``nn.MultiheadAttention`` reads ``out_proj.weight``; ``nn.TransformerEncoderLayer``'s fast path
reads everything) gathers its whole subtree. ``LEAF_TYPES`` lists torch's; others are flagged
with ``dslaunch.utils.set_z3_leaf_modules`` (DeepSpeed's name and ``_z3_leaf`` attribute).

collective: gathers are broadcasts issued in the same order on every rank, which holds because
every rank runs the same modules and the same autograd graph, and the prefetch decides from the
same trace and counts on every rank (releases are local).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dslaunch.runtime.zero import params as zp
from dslaunch.runtime.zero.prefetch import Event, FetchLimits, LiveParams, Trace

__all__ = ["ParamFetcher", "LEAF_TYPES", "external_params", "module_params"]

LEAF_TYPES: tuple[type, ...] = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                                torch.nn.TransformerDecoderLayer)


def external_params(module: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """The parameters ``register_external_parameter`` attached to ``module`` (created on demand)."""
    if "_dsl_external_params" not in module.__dict__:
        module._dsl_external_params = {}
    return module._dsl_external_params


def module_params(m: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ``m``'s forward uses: its own, a leaf module's whole subtree, and those
    ``register_external_parameter`` attached to it (each once)."""
    leaf = getattr(m, "_z3_leaf", False) or isinstance(m, LEAF_TYPES)
    own = list(m.parameters(recurse=leaf))
    extra = m.__dict__.get("_dsl_external_params", {})
    return own + [p for p in extra.values() if all(p is not q for q in own)]


class _Saved:
    """What the saved-tensor hook keeps instead of a partitioned parameter (or a view of it)."""

    __slots__ = ("param", "view")

    def __init__(self, param: torch.nn.Parameter, view: tuple | None):
        self.param, self.view = param, view


def _pack(t: torch.Tensor) -> Any:
    p = t if zp.is_partitioned(t) else t._base
    if p is None or not zp.is_partitioned(p) or p.ds_persist:
        return t
    if p is t:
        return _Saved(p, None)
    return _Saved(p, (t.size(), t.stride(), t.storage_offset() - p.data.storage_offset()))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]  # a classmethod; put back as it was
# private, as torch.compile uses it; without it custom Functions save through the hooks (plain tensors)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply`` while a stage-3 forward runs: unhooked saves under a fetcher's hooks."""
    top = _top_hooks(True) if _top_hooks is not None else None
    fetcher = getattr(top[1], "__self__", None) if top is not None else None
    if not isinstance(fetcher, ParamFetcher) or top[0] is not _pack:
        return _FUNCTION_APPLY.__func__(cls, *args, **kwargs)
    return fetcher.apply_unhooked(cls, args, kwargs)


def _saved_by(node: Any) -> tuple:
    """What a custom Function's node saved ((): none, or unreadable now: torch reports that in backward)."""
    try:
        return tuple(node.saved_tensors) if node is not None and hasattr(node, "saved_tensors") else ()
    except RuntimeError:
        return ()


def _first_node(out: Any) -> Any:
    """The backward node of a Function's outputs (the first output with a grad_fn), or None."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            return t.grad_fn
    return None


class _WatchedParams(dict):
    """A module's ``_parameters`` that tells the fetcher when a forward reads a parameter that is
    not whole (``module.weight`` goes through ``__getitem__``; iteration and ``state_dict`` do not).
    Copies and pickles are plain dicts: the fetcher belongs to this engine's model only."""

    def __init__(self, params: dict, fetcher: ParamFetcher):
        super().__init__(params)
        self._fetcher = fetcher

    def __getitem__(self, key: str) -> Any:
        p = super().__getitem__(key)
        if (self._fetcher._stack and zp.is_partitioned(p)
                and p.ds_status is not zp.ZeroParamStatus.AVAILABLE):
            self._fetcher.read_outside(p)
        return p

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        import copy

        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


class ParamFetcher:
    """Registers the gather/release hooks on every submodule of ``module``.

    Args:
        module: the model.
        params: every partitioned parameter the engine trains (released after backward).
        limits: prefetch, live-parameter and reuse limits (DeepSpeed's defaults).
    """

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter],
                 limits: FetchLimits = FetchLimits()):
        self.module, self.params = module, params
        self._flats = zp.flats(params)
        self.live = LiveParams(limits)
        # the hooked forwards in flight, innermost last: each module and the parameters it holds
        self._stack: list[tuple[torch.nn.Module, list[torch.nn.Parameter]]] = []
        self._saving: contextlib.AbstractContextManager | None = None
        self._wrapped_apply = False  # this fetcher put _apply in torch.autograd.Function
        self._traces: dict[tuple[bool, bool], Trace] = {}
        self._mode: tuple[bool, bool] | None = None  # None: no iteration open
        self._recording: list[Event] | None = None
        self.replay: Trace | None = None
        self.cursor = 0
        self.handles = []
        for m in module.modules():
            self.handles.append(m.register_forward_pre_hook(self._before))
            self.handles.append(m.register_forward_hook(self._after, always_call=True))
            m.__dict__["_parameters"] = _WatchedParams(m._parameters, self)

    @staticmethod
    def _used_by(m: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in module_params(m) if zp.is_partitioned(p)]

    # ----- iterations and events ----------------------------------------------------------------
    def _begin(self) -> None:
        self._end()
        zp.fence(self._flats)  # shared shards: what any rank wrote since the last step is seen
        self._mode = (self.module.training, torch.is_grad_enabled())
        self.replay = self._traces.get(self._mode)
        self._recording = None if self.replay is not None else []
        self.cursor = 0

    def _end(self) -> None:
        if self._mode is None:
            return
        if self._recording:
            self._traces[self._mode] = Trace(self._recording)
        self._mode, self._recording, self.replay = None, None, None
        self.live.release_all(self.params)

    def _event(self, key: tuple, used: list[torch.nn.Parameter]) -> None:
        """A fetch: record or check it against the trace, gather ``used``, prefetch what follows."""
        if self._recording is not None:
            self._recording.append(Event(key, tuple(used)))
        elif self.replay is not None:
            if self.cursor < len(self.replay.events) and self.replay.events[self.cursor].key == key:
                self.live.consume(self.cursor)
                self.cursor += 1
            else:  # another path than recorded: on demand from here, record the next iteration
                del self._traces[self._mode]
                self.replay = None
                self.live.reserved.clear()
        self.live.fetch(used)
        if self.replay is not None and self.live.limits.prefetch_numel > 0:
            self.live.prefetch(self.replay, self.cursor)

    def release(self, params: list[torch.nn.Parameter]) -> None:
        """Release those of ``params`` nobody uses, unless the trace says they are reused soon."""
        self.live.release(params, self.replay, self.cursor)

    def grad_taken(self, p: torch.nn.Parameter) -> None:
        """Backward is done with ``p`` (its gradient was taken): release it unless reused soon."""
        self.live.busy.discard(id(p))
        self.release([p])

    # ----- custom autograd Functions -------------------------------------------------------------
    def apply_unhooked(self, cls: type, args: tuple, kwargs: dict) -> Any:
        """Run ``cls.apply`` with this fetcher's hooks (on top) lifted; gather what it saved in backward."""
        self._saving.__exit__(None, None, None)
        try:
            out = _FUNCTION_APPLY.__func__(cls, *args, **kwargs)
        finally:
            self._saving.__enter__()
        node = _first_node(out)
        saved = [t for t in _saved_by(node) if zp.is_partitioned(t) and not t.ds_persist]
        if saved:
            node.register_prehook(lambda grads: self._gather_saved(saved))
        return out

    def _gather_saved(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            self._unpack(_Saved(p, None))

    def _wrap_apply(self) -> None:
        if torch.autograd.Function.__dict__["apply"] is _FUNCTION_APPLY:
            torch.autograd.Function.apply = classmethod(_apply)
            self._wrapped_apply = True

    def _unwrap_apply(self) -> None:
        if self._wrapped_apply:
            torch.autograd.Function.apply = _FUNCTION_APPLY
            self._wrapped_apply = False

    # ----- hooks --------------------------------------------------------------------------------
    def _unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _Saved):
            return saved
        p = saved.param
        self.live.busy.add(id(p))  # whole until its gradient is taken
        self._event(("b", p.ds_id), [p])
        if saved.view is None:
            return p
        size, stride, offset = saved.view
        return p.data.as_strided(size, stride, p.data.storage_offset() + offset)

    def _before(self, m: torch.nn.Module, args: Any) -> None:
        if not self._stack and not _in_backward():
            # outermost hooked forward: a new iteration; partitioned tensors saved by reference
            self._begin()
            self._saving = torch.autograd.graph.saved_tensors_hooks(_pack, self._unpack)
            self._saving.__enter__()
            self._wrap_apply()
        used = self._used_by(m)
        self._stack.append((m, used))
        for p in used:  # held first: the prefetch's room-making must not release them
            p._dsl_users += 1
        if used:
            self._event(("f", id(m)), used)

    def _after(self, m: torch.nn.Module, args: Any, out: Any) -> None:
        _, used = self._stack.pop()
        for p in used:
            p._dsl_users -= 1
        if _in_backward():
            # an activation-checkpointing recompute: what it saved for its backward holds the
            # parameters themselves, so they stay whole until their gradients are taken
            self.live.busy.update(id(p) for p in used)
        else:
            self.release(used)
        if not self._stack and not _in_backward():
            # shared shards: every rank's reads of this forward are done before any rank writes its
            # shard (a load_state_dict after an evaluation; backward's reads end at its last reduce)
            zp.fence(self._flats)
        if not self._stack and self._saving is not None:
            self._unwrap_apply()
            self._saving.__exit__(None, None, None)
            self._saving = None
            if not torch.is_grad_enabled():
                self._end()  # nothing saved for a backward: the iteration is over

    def read_outside(self, p: torch.nn.Parameter) -> None:
        """A forward read ``p``, a partitioned parameter of a module not running (``F.linear(x,
        self.other.weight)``): gather it now and from now on with the running module, as if it
        had been named with ``register_external_parameter`` (DeepSpeed finds these the same way).

        collective: every rank's forward reads the same parameters in the same order."""
        m, used = self._stack[-1]
        external_params(m)[id(p)] = p
        used.append(p)  # released with the running module's own
        p._dsl_users += 1
        self._event(("x", id(m), p.ds_id), [p])

    def release_idle(self) -> None:
        """End the iteration: release every parameter no forward holds (after backward)."""
        self._end()
        self.live.release_all(self.params)
