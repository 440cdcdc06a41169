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

``ShardedGradients`` and ``ScopedGradients`` (stages 2 and 3, ``sharded_gradients.py``): only this
rank's shard of the gradient, reduced every micro step.

Both hand the strategy this rank's reduced, not yet post-scaled, gradient per group (``shards``).

Where the script, not the micro-step count, ends the window: with ``managed_gradient_accumulation:
false`` no backward is a boundary and ``end_window`` (the script's ``step()``) completes it: stages 0/1
reduce the summed gradient then, in one pass (what the boundary backward would have done), stage 2
has reduced every micro step already and only completes the ``layout_invariant`` tree. Under
``hold`` (``engine.coalesce_grad_reduction()``) every backward leaves its gradients on the rank
(stages 2/3: in ``.grad``, summed there by autograd in the parameters' dtype, as DeepSpeed's; not
in fp32 as stage 2's shard sums micro steps) and ``end_window`` reduces the sum once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.zero import grad_norm
from dslaunch.runtime.zero.exchange import GradientExchange
from dslaunch.runtime.zero.flat import FlatGroup
from dslaunch.runtime.zero.offload_states import Holder
from dslaunch.runtime.zero.reducer import MAX_INFLIGHT_BUFFERS, BucketReducer
from dslaunch.runtime.zero.specs import CommSettings

__all__ = ["GradientPath", "FullGradients", "gradient_is_whole", "UNREDUCED_AT_STEP"]


def gradient_is_whole(p: torch.Tensor) -> bool:
    """False while a tiled computation (ALST's ``TiledMLP``...) has added only some of its slices'
    gradients to ``p.grad`` (DeepSpeed's ``ds_grad_is_ready``): not reduced or released before."""
    return getattr(p, "ds_grad_is_ready", True) is not False


UNREDUCED_AT_STEP = ("engine.step() at a gradient accumulation boundary found gradients that were never reduced "
                     "across ranks: the last engine.backward() before it ran inside no_sync() or before the "
                     "boundary, or with enable_backward_allreduce off; run the boundary micro step's backward "
                     "outside no_sync(), or call engine.allreduce_gradients() before step()")


class GradientPath(ABC):
    """Gradient storage, the backward hooks that fill it and the reducer that averages it.

    collective: construct on all ranks; ``end_backward`` is a collective where it reduces.
    """

    owned_only = False  # only this rank's range of a reduced bucket is read (the exchange may skip the rest)
    refusal: str | None = None  # why a backward may not write gradients now (offload_states)

    def __init__(self, groups: list[FlatGroup], comm: CommSettings, world_size: int,
                 exchange: GradientExchange | None, *, max_inflight: int, source: Any = None, sink: Any = None):
        self.groups, self.comm = groups, comm
        self._boundary = True
        self._sync = True  # False inside engine.no_sync()
        self._held = False  # hold(): no reduction until end_window (coalesce_grad_reduction)
        self._pending = False  # gradients arrived that no end_backward has completed yet
        self.reducer = BucketReducer(groups, comm.reduce_bucket_numel, comm.comm_dtype, comm.pre_factor(),
                                     max_inflight, world_size, exchange, source, sink)
        for gi, g in enumerate(groups):
            for pi, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(self._hook(gi, pi))

    def begin_micro_step(self, boundary: bool, sync: bool = True) -> None:
        self._boundary, self._sync = boundary, sync

    def hold(self) -> None:
        """From now on backward leaves every gradient on this rank, unreduced, until ``end_window``."""
        self._held = True

    @abstractmethod
    def end_window(self, reduce: bool = True) -> None:
        """The script ended the accumulation window (``step()`` with ``managed_gradient_accumulation:
        false``, or the end of ``hold``): reduce what its backwards left on this rank (collective),
        or with ``reduce=False`` only stop holding (the block raised: no collective)."""

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
            if self.refusal is not None:  # the buffers are offloaded: their storage is gone
                raise UsageError(self.refusal)
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

    def grad_holders(self) -> list[Holder]:
        """Where this path's gradient tensors are held (``offload_states``' ``lp_grads``): its own
        buffers (``_buffer_holders``) and each ``.grad`` (hidden while offloaded)."""
        return [*self._buffer_holders(), *(Holder(p, "grad", hide=True) for g in self.groups for p in g.params)]

    @abstractmethod
    def _buffer_holders(self) -> list[Holder]:
        """This path's own gradient buffers."""


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
        if self.comm.overlap_comm and self._reduces_now:
            self.reducer.ready(gi, pi)

    @property
    def _reduces_now(self) -> bool:
        """This backward ends the window: the buffer is reduced as it ends."""
        return self._boundary and self._sync and not self._held

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
        if not self._reduces_now:
            self._unreduced = True
            return
        self.reducer.flush()
        self._unreduced = False

    def end_window(self, reduce: bool = True) -> None:
        self._held = False
        if reduce and self._unreduced:  # the sum of the window's backwards, reduced in one pass
            self.reducer.flush()
            self._unreduced = False

    def shards(self) -> list[torch.Tensor]:
        if self._unreduced:
            raise UsageError(UNREDUCED_AT_STEP)
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

    def _buffer_holders(self) -> list[Holder]:
        return [*(Holder(self._gflat, gi) for gi in range(len(self._gflat))),
                *(Holder(views, pi) for views in self._views for pi in range(len(views))),
                *(Holder(self._master_grads, gi) for gi in range(len(self._master_grads)))]

    def held_bytes(self) -> int:
        full = sum(gf.numel() * gf.element_size() for gf in self._gflat)
        return full + sum(t.numel() * 4 for t in self._master_grads if t is not None)
