"""How gradients are kept between micro steps and reduced across ranks: the two gradient paths.

``FullGradients`` (stages 0 and 1): every rank holds the full gradient in one flat buffer per
param group. After a step every ``param.grad`` is None, so the first micro step's fresh gradient
is copied into the buffer by the hook (no zeroing pass) and ``.grad`` becomes a view of it; later
micro steps accumulate in place. Micro steps between boundaries cost no communication. On the
boundary micro step the buffer is all-reduced in place by the ``BucketReducer``; with
``overlap_comm`` each bucket launches from a post-accumulate-grad hook as soon as backward has
produced all of its gradients. A boundary step applies only reduced gradients: if the last
backward before it ran inside ``no_sync()`` (or not at the boundary), each rank would apply its own
gradient and the ranks would silently diverge, so the step raises ``UsageError`` instead. With
``data_types.grad_accum_dtype: "fp32"`` and a 16-bit model the buffer is fp32 and never a ``.grad``:
each micro step's 16-bit ``.grad`` is added to it (converted exactly) and freed, in its hook, or for
all parameters once backward ends (bf16's ``immediate_grad_update: false``: the same numbers, every
16-bit gradient alive until then, and no bucket launched from a hook); the sum is reduced in the
model dtype unless ``communication_data_type`` says otherwise, as DeepSpeed's.

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

Both hand the strategy this rank's reduced, not yet post-scaled, gradient per group (``shards``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any

import torch

from dslaunch.errors import NoSyncError, UsageError
from dslaunch.runtime.zero import grad_norm
from dslaunch.runtime.zero.exchange import GradientExchange
from dslaunch.runtime.zero.flat import FlatGroup
from dslaunch.runtime.zero.reducer import MAX_INFLIGHT_BUFFERS, BucketReducer
from dslaunch.runtime.zero.specs import CommSettings

__all__ = ["GradientPath", "FullGradients", "ShardedGradients", "ScopedGradients", "gradient_is_whole"]


def gradient_is_whole(p: torch.Tensor) -> bool:
    """False while a tiled computation (ALST's ``TiledMLP``...) has added only some of its slices'
    gradients to ``p.grad`` (DeepSpeed's ``ds_grad_is_ready``): not reduced or released before."""
    return getattr(p, "ds_grad_is_ready", True) is not False


class GradientPath(ABC):
    """Gradient storage, the backward hooks that fill it and the reducer that averages it.

    collective: construct on all ranks; ``end_backward`` is a collective where it reduces.
    """

    owned_only = False  # only this rank's range of a reduced bucket is read (the exchange may skip the rest)

    def __init__(self, groups: list[FlatGroup], comm: CommSettings, world_size: int,
                 exchange: GradientExchange | None, *, max_inflight: int, source: Any = None, sink: Any = None):
        self.groups, self.comm = groups, comm
        self._boundary = True
        self._sync = True  # False inside engine.no_sync()
        self._pending = False  # gradients arrived that no end_backward has completed yet
        self.reducer = BucketReducer(groups, comm.reduce_bucket_numel, comm.comm_dtype, comm.pre_factor(),
                                     max_inflight, world_size, exchange, source, sink)
        for gi, g in enumerate(groups):
            for pi, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(self._hook(gi, pi))

    def begin_micro_step(self, boundary: bool, sync: bool = True) -> None:
        self._boundary, self._sync = boundary, sync

    @property
    def boundary_done(self) -> bool:
        """The last ``end_backward`` completed a boundary micro step with views of its gradients for
        ``shards`` (no copy to make): the step's gradients are final and can be read ahead."""
        return False

    @property
    def backward_pending(self) -> bool:
        """A backward produced gradients since the last ``end_backward``: the script ran
        ``loss.backward()`` itself and nothing has completed this micro step's reductions yet."""
        return self._pending

    def _hook(self, gi: int, pi: int):
        def on_grad(p: torch.Tensor) -> None:
            self._pending = True
            if p.grad is not None and p.grad.layout != torch.strided:
                # nn.Embedding(sparse=True): every path keeps gradients dense (flat buffers,
                # shards), so the sparse rows are scattered into a dense gradient here
                p.grad = p.grad.to_dense()
            if gradient_is_whole(p):
                self._on_grad(gi, pi)
        return on_grad

    @abstractmethod
    def _on_grad(self, gi: int, pi: int) -> None:
        """Backward accumulated param pi of group gi's gradient into ``.grad``."""

    @abstractmethod
    def end_backward(self) -> None:
        """After loss.backward(): complete this micro step's reductions (collective)."""

    @abstractmethod
    def shards(self) -> list[torch.Tensor]:
        """This rank's reduced (not yet post-scaled) fp32 gradient of each group's master.

        Raises:
            UsageError: the gradients were not reduced across ranks.
        """

    def shard(self, gi: int) -> torch.Tensor:
        """Group ``gi``'s part of ``shards()`` where the next step reads it (in the group's dtype
        where the whole gradient is kept): a write to it changes that step."""
        return self.shards()[gi]

    def norm_cuts(self, gi: int) -> list[int]:
        """Positions in group ``gi``'s flat vector where this path writes the final gradient in
        separate pieces: the gradient norm's units are cut there too (``grad_norm.units``)."""
        return []

    def folded_sumsq(self, gi: int) -> list[grad_norm.Sum] | None:
        """Group ``gi``'s gradient norm units' sums of squares (``grad_norm.units`` of the whole
        shard), taken as the boundary backward wrote the gradients; None where this path does not
        fold them or something may have changed the gradients since."""
        return None

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget the accumulated gradients."""

    def local_gradient(self, gi: int) -> torch.Tensor:
        """Group ``gi``'s whole gradient as this rank holds it (unreduced where the exchange left
        it local); only where the full gradient is kept.

        Raises:
            UsageError: this gradient path keeps only a shard.
        """
        raise UsageError(f"{type(self).__name__} keeps only this rank's gradient shard, not the whole gradient")

    def unreduced_gradient(self, gi: int) -> torch.Tensor | None:
        """Group ``gi``'s whole gradient as this rank summed it, while a backward since the last
        reduction left it local (inside ``no_sync()``, before the boundary); None otherwise."""
        return None

    def param_gradient(self, gi: int, pi: int) -> torch.Tensor | None:
        """Param ``pi`` of group ``gi``'s whole gradient of this window where the step reads it
        (after ``end_backward``; a write changes the step); None where only a shard is kept."""
        return None

    @abstractmethod
    def held_bytes(self) -> int:
        """Bytes of gradient storage this rank keeps between micro steps."""


class FullGradients(GradientPath):
    """The full gradient on every rank, all-reduced at the accumulation boundary (stages 0/1)."""

    def __init__(self, groups: list[FlatGroup], comm: CommSettings, world_size: int,
                 exchange: GradientExchange | None = None):
        # fp32 accumulation of a 16-bit model (``comm.accum_dtype``): the buffer is fp32 and never a
        # ``.grad``; each 16-bit ``.grad`` is added to it and freed (see ``_adopt_grad``).
        self._widened = comm.accum_dtype is not None and any(g.dtype != comm.accum_dtype for g in groups)
        self._in_hook = not self._widened or comm.immediate_grad_update
        # Every element in [0, numel) is written by the first backward (_adopt_grad) before use.
        # (from the exchange: with shared-memory collectives it lives where the peers can sum it in place)
        self._gflat = [(exchange or GradientExchange()).gradient_buffer(
            g.layout.padded, comm.accum_dtype if self._widened else g.dtype, g.device) for g in groups]
        self._views = [g.param_views(gf) for g, gf in zip(groups, self._gflat, strict=True)]
        # widened: which params' buffer slices hold this window's sum so far (else: ``.grad`` is not None)
        self._written = [[False] * len(g.params) for g in groups]
        self._master_grads: list[torch.Tensor | None] = [None] * len(groups)
        self._unreduced = False  # a backward since the last reduction left rank-local gradients
        if self._widened and comm.comm_dtype is None:  # the fp32 sums cross the wire in the model dtype (DeepSpeed's)
            comm = replace(comm, comm_dtype=groups[0].dtype)
        # Reduced in place: only a copy in another communication dtype holds a pooled buffer.
        super().__init__(groups, comm, world_size, exchange, max_inflight=MAX_INFLIGHT_BUFFERS,
                         source=self._bucket_grads)

    def _bucket_grads(self, bi: int) -> torch.Tensor:
        b = self.reducer.buckets[bi]
        return self._gflat[b.group][b.begin:b.end]

    def _on_grad(self, gi: int, pi: int) -> None:
        if not self._in_hook:  # immediate_grad_update false: end_backward adds them all
            return
        self._adopt_grad(gi, pi)
        if self.comm.overlap_comm and self._boundary and self._sync:
            self.reducer.ready(gi, pi)

    def _adopt_grad(self, gi: int, pi: int, unused_is_zero: bool = False) -> None:
        # .grad was None (after a step, or module.zero_grad()): autograd made a fresh tensor, which
        # is the whole gradient so far; copy it into the flat buffer and point .grad there.
        p, view = self.groups[gi].params[pi], self._views[gi][pi]
        if self._widened:  # this micro step's 16-bit gradient into the fp32 sum (exact), then freed
            if p.grad is not None:
                view.add_(p.grad) if self._written[gi][pi] else view.copy_(p.grad)
                p.grad = None
                self._written[gi][pi] = True
            elif unused_is_zero and not self._written[gi][pi]:
                view.zero_()
                self._written[gi][pi] = True
            return
        if p.grad is None:
            if unused_is_zero:  # no gradient this window (unused parameter)
                view.zero_()
                p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _adopt_all(self) -> None:
        for gi, g in enumerate(self.groups):
            for pi in range(len(g.params)):
                self._adopt_grad(gi, pi, unused_is_zero=True)

    def end_backward(self) -> None:
        self._pending = False
        self._adopt_all()
        if not (self._boundary and self._sync):
            self._unreduced = True
            return
        self.reducer.flush()
        self._unreduced = False

    def shards(self) -> list[torch.Tensor]:
        if self._unreduced:
            raise UsageError("engine.step() at a gradient accumulation boundary found gradients that "
                             "were never reduced across ranks: the last engine.backward() before it ran "
                             "inside no_sync() or before the boundary; run the boundary micro step's "
                             "backward outside no_sync()")
        self._adopt_all()  # a step without backward sees zero gradients
        grads = []
        for gi, (g, gf) in enumerate(zip(self.groups, self._gflat, strict=True)):
            own = gf[g.layout.start:g.layout.end]
            if gf.dtype != torch.float32:
                if self._master_grads[gi] is None:
                    self._master_grads[gi] = torch.empty_like(g.master.data)
                own = self._master_grads[gi].copy_(own)
            grads.append(own)
        return grads

    def shard(self, gi: int) -> torch.Tensor:
        self.shards()  # the checks; its 16-bit fp32 copy is remade from the buffer at every call
        lay = self.groups[gi].layout
        return self._gflat[gi][lay.start:lay.end]

    def local_gradient(self, gi: int) -> torch.Tensor:
        self._adopt_all()  # a step without backward sees zero gradients
        return self._gflat[gi][:self.groups[gi].layout.numel]

    def unreduced_gradient(self, gi: int) -> torch.Tensor | None:
        return self.local_gradient(gi) if self._unreduced else None

    def param_gradient(self, gi: int, pi: int) -> torch.Tensor | None:
        return self._views[gi][pi]  # ``.grad``'s memory, or the fp32 sum that replaces it

    def zero_grad(self) -> None:
        # None, not zeros: the next backward's first gradient overwrites the buffer (see _adopt_grad).
        self._unreduced = False
        for gi, g in enumerate(self.groups):
            if self._widened:
                self._written[gi] = [False] * len(g.params)
            for p in g.params:
                p.grad = None

    def held_bytes(self) -> int:
        full = sum(gf.numel() * gf.element_size() for gf in self._gflat)
        return full + sum(t.numel() * 4 for t in self._master_grads if t is not None)


class ShardedGradients(GradientPath):
    """Only this rank's fp32 gradient shard; buckets reduced into it as backward runs (stage 2)."""

    owned_only = True

    def __init__(self, groups: list[FlatGroup], comm: CommSettings, world_size: int,
                 exchange: GradientExchange | None = None):
        self._shards: list[torch.Tensor | None] = [None] * len(groups)  # made by the first fold
        self._fresh = True  # first micro step since zero_grad: copy into the shard instead of add
        self._micro = 0  # micro steps reduced since zero_grad (layout_invariant's tree)
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

    def shards(self) -> list[torch.Tensor]:
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
        self._unit_sums.clear()
        self._fresh, self._micro = True, 0  # no zeroing pass: the next reduction overwrites the shard
        for g in self.groups:
            for p in g.params:
                p.grad = None

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
