"""ZeRO stage 0: plain data parallelism with a bucketed gradient all-reduce.

Every rank holds the full gradient in one flat buffer per param group. After a step every
``param.grad`` is None, so the first micro step's fresh gradient is copied into the buffer by the
hook (no zeroing pass) and ``.grad`` becomes a view of it; later micro steps accumulate in place.
Micro steps between boundaries cost no communication. On the boundary micro step the buffer is all-reduced in buckets of
``reduce_bucket_size`` elements; with ``overlap_comm`` each bucket is launched asynchronously from a
post-accumulate-grad hook as soon as backward has produced all of its gradients. Buckets launch in
one fixed order (last bucket first) on every rank, so collectives always match. The reduction is in
place; only a different communication dtype needs buffers (pooled, at most
``MAX_INFLIGHT_BUFFERS`` in flight).

A boundary step applies only reduced gradients: if the last backward before it ran inside
``no_sync()`` (or not at the boundary), each rank would apply its own gradient and the ranks
would silently diverge, so the step raises ``UsageError`` instead.
"""

from __future__ import annotations

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.zero.reducer import MAX_INFLIGHT_BUFFERS, BucketReducer
from dslaunch.runtime.zero.strategy import ZeroStrategy

__all__ = ["Stage0"]


class Stage0(ZeroStrategy):
    """Replicated optimizer state; full gradients all-reduced at the accumulation boundary."""

    stage = 0
    partitioned = False

    def _init_gradients(self) -> BucketReducer:
        # Every element in [0, numel) is written by the first backward (_adopt_grad) before use.
        self._gflat = [torch.empty(g.layout.padded, dtype=g.dtype, device=g.flat.device)
                       for g in self.groups]
        self._views = [g.param_views(gf) for g, gf in zip(self.groups, self._gflat, strict=True)]
        self._master_grads: list[torch.Tensor | None] = [None] * len(self.groups)
        self._unreduced = False  # a backward since the last reduction left rank-local gradients
        for gi, g in enumerate(self.groups):
            for pi, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(self._hook(gi, pi))
        # In place in the full buffer; only a converted copy holds a pooled buffer.
        return self._make_reducer(MAX_INFLIGHT_BUFFERS, source=self._bucket_grads)

    def _bucket_grads(self, bi: int) -> torch.Tensor:
        b = self._reducer.buckets[bi]
        return self._gflat[b.group][b.begin:b.end]

    def _hook(self, gi: int, pi: int):
        def on_grad(p: torch.Tensor) -> None:
            self._adopt_grad(gi, pi)
            if self.comm.overlap_comm and self._boundary and self._sync:
                self._reducer.ready(gi, pi)
        return on_grad

    def _adopt_grad(self, gi: int, pi: int, unused_is_zero: bool = False) -> None:
        # .grad was None (after a step, or module.zero_grad()): autograd made a fresh tensor, which
        # is the whole gradient so far; copy it into the flat buffer and point .grad there.
        p, view = self.groups[gi].params[pi], self._views[gi][pi]
        if p.grad is None:
            if unused_is_zero:  # no gradient this window (unused parameter)
                view.zero_()
                p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def end_backward(self) -> None:
        for gi, g in enumerate(self.groups):
            for pi in range(len(g.params)):
                self._adopt_grad(gi, pi, unused_is_zero=True)
        if not (self._boundary and self._sync):
            self._unreduced = True
            return
        self._reducer.flush()
        self._unreduced = False
    def _gather_grad_shards(self) -> list[torch.Tensor]:
        if self._unreduced:
            raise UsageError("engine.step() at a gradient accumulation boundary found gradients that "
                             "were never reduced across ranks: the last engine.backward() before it ran "
                             "inside no_sync() or before the boundary; run the boundary micro step's "
                             "backward outside no_sync()")
        for gi, g in enumerate(self.groups):  # a step without backward sees zero gradients
            for pi in range(len(g.params)):
                self._adopt_grad(gi, pi, unused_is_zero=True)
        grads = []
        for gi, (g, gf) in enumerate(zip(self.groups, self._gflat, strict=True)):
            own = gf[g.layout.start:g.layout.end]
            if g.dtype == torch.float32:
                g.master.grad = own
            else:
                if self._master_grads[gi] is None:
                    self._master_grads[gi] = torch.empty_like(g.master.data)
                g.master.grad = self._master_grads[gi].copy_(own)
            grads.append(g.master.grad)
        return grads

    def zero_grad(self) -> None:
        # None, not zeros: the next backward's first gradient overwrites the buffer (see _adopt_grad).
        self._unreduced = False
        for g in self.groups:
            for p in g.params:
                p.grad = None

    def _grad_bytes(self) -> int:
        full = sum(gf.numel() * gf.element_size() for gf in self._gflat)
        return full + sum(t.numel() * 4 for t in self._master_grads if t is not None)
