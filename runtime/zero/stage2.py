"""ZeRO stage 2: gradients reduced into the owning rank's shard as backward produces them.

No full gradient buffer is kept. A post-accumulate-grad hook copies each fresh ``param.grad`` into
its bucket (``reduce_bucket_size`` elements of whole params, in the communication dtype,
``contiguous_gradients`` always on) and frees it; a complete bucket is all-reduced (on gloo faster
than reduce-scatter) and each rank adds the part inside its own range to an fp32 gradient shard of
``partition_range`` size. Buckets launch in one fixed order on every rank (last first). With
``overlap_comm`` reductions run asynchronously while backward continues and finished ones are
folded in without blocking (backward waits only past ``MAX_INFLIGHT_BUFFERS`` buckets in flight,
which bounds memory); without it each bucket is reduced at once. Bucket buffers come from the
strategy's ``BufferPool`` (kept between steps, counted by ``held_bytes()["comm_buffers"]``).
Every micro step communicates (the shard is all a rank keeps), as in DeepSpeed. Optimizer state,
master weights and gradients per rank: 1/N of stage 0; the update is published like stage 1.
"""

from __future__ import annotations

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.zero.reducer import MAX_INFLIGHT_BUFFERS, BucketReducer
from dslaunch.runtime.zero.strategy import ZeroStrategy

__all__ = ["Stage2"]


class Stage2(ZeroStrategy):
    """Partitioned optimizer state and gradients; bucketed reduction from backward hooks."""

    stage = 2
    partitioned = True

    def _init_gradients(self) -> BucketReducer:
        self._shards = [torch.empty(g.layout.end - g.layout.start, dtype=torch.float32,
                                    device=g.flat.device) for g in self.groups]
        self._fresh = True  # first micro step since zero_grad: copy into the shard instead of add
        for gi, g in enumerate(self.groups):
            for pi, p in enumerate(g.params):
                p.grad = None
                p.register_post_accumulate_grad_hook(self._hook(gi, pi))
        limit = MAX_INFLIGHT_BUFFERS if self.comm.overlap_comm else 0
        return self._make_reducer(limit, sink=self._fold)

    def begin_micro_step(self, boundary: bool, sync: bool = True) -> None:
        if not sync:
            raise UsageError("no_sync() is not supported with ZeRO stage 2: gradients are reduced "
                             "into their owning shard every micro step (same as DeepSpeed)")
        super().begin_micro_step(boundary, sync)

    def _hook(self, gi: int, pi: int):
        def on_grad(p: torch.Tensor) -> None:
            self._take_grad(gi, pi)
            self._reducer.ready(gi, pi)
        return on_grad

    def _take_grad(self, gi: int, pi: int) -> None:
        """Move param pi's gradient (zeros if it got none) into its bucket and free it."""
        bi = self._reducer.bucket_of(gi, pi)
        a = self._reducer.buckets[bi].begin
        p = self.groups[gi].params[pi]
        pa, pb = self.groups[gi].layout.param_range(pi)
        dst = self._reducer.staging(bi)[pa - a:pb - a]
        if p.grad is None:
            dst.zero_()
        else:
            dst.copy_(p.grad.reshape(-1))
            p.grad = None

    def _fold(self, bi: int, buf: torch.Tensor) -> None:
        """Add the part of a reduced bucket inside this rank's range to the gradient shard."""
        b = self._reducer.buckets[bi]
        lay = self.groups[b.group].layout
        lo, hi = max(b.begin, lay.start), min(b.end, lay.end)
        if lo < hi:
            dst, src = self._shards[b.group][lo - lay.start:hi - lay.start], buf[lo - b.begin:hi - b.begin]
            dst.copy_(src) if self._fresh else dst.add_(src)

    def end_backward(self) -> None:
        # Buckets whose params got no gradient (unused in this forward) still reduce, as zeros.
        self._reducer.flush(fill=self._take_grad)
        self._fresh = False  # every element of the shard has now been written

    def _gather_grad_shards(self) -> list[torch.Tensor]:
        for g, s in zip(self.groups, self._shards, strict=True):
            if self._fresh:  # a step without backward sees zero gradients
                s.zero_()
            g.master.grad = s
        return self._shards

    def zero_grad(self) -> None:
        self._fresh = True  # no zeroing pass: the next reduction overwrites the shard
        for g in self.groups:
            for p in g.params:
                p.grad = None

    def _grad_bytes(self) -> int:
        return sum(s.numel() * 4 for s in self._shards)
