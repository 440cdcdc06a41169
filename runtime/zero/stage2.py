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

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import UsageError
from dslaunch.runtime.zero.strategy import MAX_INFLIGHT_BUFFERS, ZeroStrategy

__all__ = ["Stage2"]


def _done(work: Any) -> bool:
    return work is None or work.is_completed()


class Stage2(ZeroStrategy):
    """Partitioned optimizer state and gradients; bucketed reduction from backward hooks."""

    stage = 2
    partitioned = True

    def _init_gradients(self) -> None:
        self._shards = [torch.empty(g.layout.end - g.layout.start, dtype=torch.float32,
                                    device=g.flat.device) for g in self.groups]
        self._inflight: deque[tuple[Any, int, torch.Tensor]] = deque()
        self._fresh = True  # first micro step since zero_grad: copy into the shard instead of add
        self._reset_buckets()
        for gi, g in enumerate(self.groups):
            for pi, p in enumerate(g.params):
                p.grad = None
                p.register_post_accumulate_grad_hook(self._hook(gi, pi))

    def begin_micro_step(self, boundary: bool, sync: bool = True) -> None:
        if not sync:
            raise UsageError("no_sync() is not supported with ZeRO stage 2: gradients are reduced "
                             "into their owning shard every micro step (same as DeepSpeed)")
        super().begin_micro_step(boundary, sync)

    def _reset_buckets(self) -> None:
        self._pending = [len(idx) for _, _, _, idx in self._bucket_list]
        self._bufs: dict[int, torch.Tensor] = {}
        self._got: dict[int, set[int]] = {}  # bucket -> params already copied in
        self._next = len(self._bucket_list) - 1

    def _buffer(self, bi: int) -> torch.Tensor:
        if bi not in self._bufs:
            gi, a, b, _ = self._bucket_list[bi]
            g = self.groups[gi]
            self._bufs[bi] = self._comm_pool.take(b - a, self._comm_dtype(g.dtype), g.flat.device)
        return self._bufs[bi]

    def _hook(self, gi: int, pi: int):
        def on_grad(p: torch.Tensor) -> None:
            bi = self._bucket_of[(gi, pi)]
            self._take_grad(bi, gi, pi)
            self._pending[bi] -= 1
            while self._next >= 0 and self._pending[self._next] == 0:
                self._launch(self._next)
                self._next -= 1
        return on_grad

    def _take_grad(self, bi: int, gi: int, pi: int) -> None:
        """Move param pi's gradient (zeros if it got none) into its bucket and free it."""
        _, a, _, _ = self._bucket_list[bi]
        p = self.groups[gi].params[pi]
        pa, pb = self.groups[gi].layout.param_range(pi)
        dst = self._buffer(bi)[pa - a:pb - a]
        self._got.setdefault(bi, set()).add(pi)
        if p.grad is None:
            dst.zero_()
        else:
            dst.copy_(p.grad.reshape(-1))
            p.grad = None

    def _launch(self, bi: int) -> None:
        buf = self._bufs.pop(bi)
        pre = self._pre_factor()
        if pre != 1.0:
            buf.mul_(pre)
        work = dist.all_reduce(buf, group=self.pg, async_op=True) if self.world_size > 1 else None
        self._inflight.append((work, bi, buf))
        # Fold finished reductions in without blocking; block only past the in-flight cap.
        limit = MAX_INFLIGHT_BUFFERS if self.comm.overlap_comm else 0
        while self._inflight and (len(self._inflight) > limit or _done(self._inflight[0][0])):
            self._finish(*self._inflight.popleft())

    def _finish(self, work: Any, bi: int, buf: torch.Tensor) -> None:
        if work is not None:
            work.wait()
        gi, a, b, _ = self._bucket_list[bi]
        lay = self.groups[gi].layout
        lo, hi = max(a, lay.start), min(b, lay.end)
        if lo < hi:
            dst, src = self._shards[gi][lo - lay.start:hi - lay.start], buf[lo - a:hi - a]
            dst.copy_(src) if self._fresh else dst.add_(src)
        self._comm_pool.give(buf)

    def end_backward(self) -> None:
        # Buckets whose params got no gradient (unused in this forward) still reduce, as zeros.
        while self._next >= 0:
            gi, _, _, idx = self._bucket_list[self._next]
            for pi in idx:
                if pi not in self._got.get(self._next, ()):
                    self._take_grad(self._next, gi, pi)
            self._launch(self._next)
            self._next -= 1
        while self._inflight:
            self._finish(*self._inflight.popleft())
        self._fresh = False  # every element of the shard has now been written
        self._reset_buckets()

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
