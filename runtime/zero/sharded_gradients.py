"""The gradient paths that keep only this rank's shard of the gradient (stages 2 and 3); the
common contract and the full-gradient path (stages 0/1) are ``gradients.py``'s.

``ShardedGradients`` (stage 2): no full gradient buffer is kept. A post-accumulate-grad hook copies
each fresh ``param.grad`` into its bucket's staging buffer (``contiguous_gradients`` always on)
and frees it; each reduced bucket's part inside this rank's range is added to an fp32 gradient
shard of ``partition_range`` size (so the micro steps are summed in fp32 whatever ``grad_accum_dtype`` says; on one rank, with nothing to scale or convert, the gradient is
written into the shard by the hook itself: the reduction would be the identity). With ``overlap_comm`` reductions run while backward continues
(backward waits only past ``MAX_INFLIGHT_BUFFERS`` buckets in flight); without it each bucket is
reduced at once. Every micro step communicates (the shard is all a rank keeps), as in DeepSpeed,
so ``no_sync()`` is refused. The boundary micro step's write into the shard (the hook's on one
rank, each bucket's fold otherwise) also takes the global norm's sums of squares
(``grad_norm.py``: ``folded_sumsq``), so the step reads the shard only for the update. Under ``layout_invariant`` the micro steps' reduced gradients are
added in a pairwise tree (``(m0 + m1) + (m2 + m3)``, a binary counter of partial sums: one extra
shard per level), not a chain, so that they complete the data group's fixed tree over ranks.

``ScopedGradients`` (stage 3) is ``ShardedGradients`` that frees the gradient shard and the
reduction buffers at ``zero_grad`` (after each step), as FSDP2 does: between steps a rank holds
only its parameter shard and optimizer state. The price is allocating them again in the next
backward (page faults, ~2 ms per 4M floats here); stage 2 keeps them (its step is short), and so
does stage 3 where every group is resident (one rank: no gathered parameter needs the room).
"""

from __future__ import annotations

import torch

from dslaunch.errors import NoSyncError, UsageError
from dslaunch.runtime.zero import grad_norm
from dslaunch.runtime.zero.exchange import GradientExchange
from dslaunch.runtime.zero.flat import FlatGroup
from dslaunch.runtime.zero.gradients import UNREDUCED_AT_STEP, GradientPath
from dslaunch.runtime.zero.offload_states import Holder
from dslaunch.runtime.zero.reducer import MAX_INFLIGHT_BUFFERS
from dslaunch.runtime.zero.specs import CommSettings

__all__ = ["ShardedGradients", "ScopedGradients"]


class ShardedGradients(GradientPath):
    """Only this rank's fp32 gradient shard; buckets reduced into it as backward runs (stage 2)."""

    owned_only = True

    def __init__(self, groups: list[FlatGroup], comm: CommSettings, world_size: int,
                 exchange: GradientExchange | None = None):
        self._shards: list[torch.Tensor | None] = [None] * len(groups)  # made by the first fold
        self._fresh = True  # first micro step since zero_grad: copy into the shard instead of add
        self._micro = 0  # micro steps reduced since zero_grad (layout_invariant's tree)
        self._unreduced = False  # a held backward left gradients in .grad that no end_window reduced
        self._partials: dict[tuple[int, int], torch.Tensor] = {}  # (group, level) -> partial sum
        for g in groups:
            for p in g.params:
                p.grad = None
        super().__init__(groups, comm, world_size, exchange,
                         max_inflight=MAX_INFLIGHT_BUFFERS if comm.overlap_comm else 0, sink=self._fold)
        # One rank, nothing to scale or convert: the reduction is the identity, so each gradient
        # goes straight into the shard (no staging copy, no fold copy, no buffers); same values.
        # (Not under layout_invariant: its micro steps are added in a tree, which the fold does.)
        self._direct = (world_size == 1 and comm.pre_factor() == 1.0 and not comm.layout_invariant
                        and all(comm.comm_dtype in (None, g.dtype) for g in groups))
        self._arrived: set[tuple[int, int]] = set()  # direct: the params written this backward
        # direct: each param's sum of squares, taken by its last write of a boundary backward (the
        # norm's units, folded: no pass over the shard at the step); None: not (all) taken
        self._sums: list[list[grad_norm.Sum | None]] = [[None] * len(g.params) for g in groups]
        self._folded = False
        # reduced buckets: each unit's sum by (group, its first element in the shard), taken by the fold
        # of the boundary micro step (not under layout_invariant: its tree adds the micro steps last)
        self._fold_norm = not comm.layout_invariant
        self._unit_sums: dict[tuple[int, int], grad_norm.Sum] = {}

    def begin_micro_step(self, boundary: bool, sync: bool = True) -> None:
        if not sync:
            raise NoSyncError("no_sync context manager is incompatible with ZeRO stages 2 and 3: gradients "
                              "are reduced into their owning shard every micro step (as in DeepSpeed); "
                              "accumulate with gradient_accumulation_steps instead")
        super().begin_micro_step(boundary, sync)
        self._folded = False

    def _on_grad(self, gi: int, pi: int) -> None:
        if self._held:  # left in .grad: the next backward's gradient is added to it by autograd
            return
        if self._direct:
            self._arrived.add((gi, pi))
            self._write_grad(gi, pi)
            return
        self._take_grad(gi, pi)
        self.reducer.ready(gi, pi)

    def _write_grad(self, gi: int, pi: int) -> None:
        """Direct: param pi's gradient (zeros if it got none) into the shard, as a fold would; freed."""
        p = self.groups[gi].params[pi]
        pa, pb = self.groups[gi].layout.param_range(pi)
        dst = self._shard(gi)[pa:pb]  # one rank: the shard starts at 0
        fold = self._boundary and pb > pa  # this write is the gradient's last before the step
        if p.grad is not None:
            src = p.grad.reshape(-1)
            if fold:
                self._sums[gi][pi] = grad_norm.write_sumsq(dst, src, add=not self._fresh)
            else:
                dst.copy_(src) if self._fresh else dst.add_(src)
            p.grad = None
            return
        if self._fresh:
            dst.zero_()
        if fold:
            self._sums[gi][pi] = grad_norm.sumsq(dst)

    def _take_grad(self, gi: int, pi: int) -> None:
        """Move param pi's gradient (zeros if it got none) into its bucket and free it."""
        bi = self.reducer.bucket_of(gi, pi)
        a = self.reducer.buckets[bi].begin
        p = self.groups[gi].params[pi]
        pa, pb = self.groups[gi].layout.param_range(pi)
        dst = self.reducer.staging(bi)[pa - a:pb - a]
        if p.grad is None:
            dst.zero_()
        else:
            dst.copy_(p.grad.reshape(-1))
            p.grad = None

    def _fold(self, bi: int, buf: torch.Tensor) -> None:
        """Add the part of a reduced bucket inside this rank's range to the gradient shard."""
        b = self.reducer.buckets[bi]
        lay = self.groups[b.group].layout
        lo, hi = max(b.begin, lay.start), min(b.end, lay.end)
        if lo < hi:
            dst, src = self._shard(b.group)[lo - lay.start:hi - lay.start], buf[lo - b.begin:hi - b.begin]
            if self.comm.layout_invariant:
                self._fold_tree(b.group, lo - lay.start, hi - lay.start, src)
            elif self._boundary and self._fold_norm:  # the last write: the norm's units too
                self._fold_units(b.group, b.params, lo, hi, src)
            else:
                dst.copy_(src) if self._fresh else dst.add_(src)

    def _fold_units(self, gi: int, params: tuple[int, ...], lo: int, hi: int, src: torch.Tensor) -> None:
        """Write flat elements [lo, hi) of group ``gi`` (``src``, a bucket of ``params``) into the
        shard, unit by unit (the bucket's edges are cuts: ``norm_cuts``), taking each one's sum of
        squares."""
        lay = self.groups[gi].layout
        shard = self._shard(gi)
        for pi in params:
            a, b = lay.param_range(pi)
            ua, ub = max(a, lo), min(b, hi)
            if ub > ua:
                self._unit_sums[gi, ua - lay.start] = grad_norm.write_sumsq(
                    shard[ua - lay.start:ub - lay.start], src[ua - lo:ub - lo], add=not self._fresh)

    def _fold_tree(self, gi: int, lo: int, hi: int, src: torch.Tensor) -> None:
        """Micro step ``m``'s reduced gradient joins the partial sums of the levels its trailing
        one bits name; the boundary's total goes into the shard (a power-of-two count ends with
        every level joined), anything else waits at the next level."""
        carry, level = src, 0
        while self._micro >> level & 1:
            carry = self._partial(gi, level)[lo:hi] + carry
            level += 1
        (self._shard(gi) if self._boundary else self._partial(gi, level))[lo:hi].copy_(carry)

    def _partial(self, gi: int, level: int) -> torch.Tensor:
        if (gi, level) not in self._partials:
            self._partials[(gi, level)] = torch.empty_like(self._shard(gi))
        return self._partials[(gi, level)]

    def _shard(self, gi: int) -> torch.Tensor:
        if self._shards[gi] is None:
            g = self.groups[gi]
            self._shards[gi] = torch.empty(g.layout.end - g.layout.start, dtype=torch.float32, device=g.device)
        return self._shards[gi]

    def end_backward(self) -> None:
        # Buckets whose params got no gradient (unused in this forward) still reduce, as zeros.
        self._pending = False
        if self._held:
            self._unreduced = True
            return
        if self._direct:
            for gi, g in enumerate(self.groups):
                for pi in range(len(g.params)):
                    if (gi, pi) not in self._arrived:
                        self._write_grad(gi, pi)
            self._arrived.clear()
            self._folded = self._boundary
        else:
            self.reducer.flush(fill=self._take_grad)
            self._folded = self._boundary and self._fold_norm
        self._fresh = False  # every element of the shard has now been written
        self._micro += 1

    def end_window(self, reduce: bool = True) -> None:
        held, self._held = self._held, False
        self._unreduced = False  # reduced below, or dropped (reduce=False: zero_grad follows)
        if not reduce:
            return
        if held:  # the held sum, reduced and folded as a boundary micro step's gradients
            self._boundary = True
            self.end_backward()
        elif self.comm.layout_invariant and self._micro:
            self._end_tree()
        self._boundary = True  # the shard is final (boundary_done: the offloaded step may read ahead)

    def _end_tree(self) -> None:
        """No backward knew it was the window's last: the tree's total waits in the partial sum of
        the top level; it becomes the shard."""
        n = self._micro
        if n & (n - 1):
            raise UsageError(f"layout_invariant sums a window's micro steps in a fixed tree, which needs a power "
                             f"of two of them (1, 2, 4...); this step() ends a window of {n} backward() calls")
        level = n.bit_length() - 1
        for gi in range(len(self.groups)):
            if (gi, level) in self._partials:
                self._shard(gi).copy_(self._partials[gi, level])

    def unreduced_gradient(self, gi: int) -> torch.Tensor | None:
        """Held (``coalesce_grad_reduction``): the whole gradient this rank's backwards summed in
        ``.grad`` so far, laid out flat (zeros for a parameter without one)."""
        if not self._held:
            return None
        g = self.groups[gi]
        flat = torch.zeros(g.layout.numel, dtype=g.dtype, device=g.device)
        for p, view in zip(g.params, g.param_views(flat), strict=True):
            if p.grad is not None:
                view.copy_(p.grad)
        return flat

    def shards(self) -> list[torch.Tensor]:
        if self._unreduced:
            raise UsageError(UNREDUCED_AT_STEP)
        shards = [self._shard(gi) for gi in range(len(self.groups))]
        if self._fresh:  # a step without backward sees zero gradients
            for s in shards:
                s.zero_()
        return shards

    def shard(self, gi: int) -> torch.Tensor:
        self._folded = False  # handed out for writing: the folded sums may no longer hold
        return super().shard(gi)

    @property
    def boundary_done(self) -> bool:
        return self._boundary and not self._fresh and not self._pending

    def norm_cuts(self, gi: int) -> list[int]:
        if self._direct or not self._fold_norm:
            return []
        return [b.begin for b in self.reducer.buckets if b.group == gi]

    def folded_sumsq(self, gi: int) -> list[grad_norm.Sum] | None:
        if not self._folded:
            return None
        if not self._direct:
            lay = self.groups[gi].layout
            return [self._unit_sums[gi, lo] for lo in sorted(k for g, k in self._unit_sums if g == gi)
                    if lo < lay.end - lay.start]
        return [s for s, (a, b) in zip(self._sums[gi], map(self.groups[gi].layout.param_range,
                                                            range(len(self._sums[gi]))), strict=True) if b > a]

    def zero_grad(self) -> None:
        self._folded = False
        self._unreduced = False
        self._unit_sums.clear()
        self._fresh, self._micro = True, 0  # no zeroing pass: the next reduction overwrites the shard
        for g in self.groups:
            for p in g.params:
                p.grad = None

    def _buffer_holders(self) -> list[Holder]:
        return [*(Holder(self._shards, gi) for gi in range(len(self._shards))),
                *(Holder(self._partials, k) for k in self._partials)]

    def held_bytes(self) -> int:
        partials = sum(t.numel() * 4 for t in self._partials.values())
        return partials + sum(s.numel() * 4 for s in self._shards if s is not None)


class ScopedGradients(ShardedGradients):
    """Stage 2's gradient shard, freed with the reduction buffers at every ``zero_grad`` (stage 3)."""

    def zero_grad(self) -> None:
        super().zero_grad()
        if all(getattr(g, "resident", False) for g in self.groups):
            return  # nothing is ever gathered (one rank): freeing lowers no peak, only costs faults
        self._shards = [None] * len(self.groups)
        self._partials.clear()
        self.reducer.pool.clear()
