"""The offloaded optimizer step: the master shard updated bucket by bucket, transfers overlapped.

The fp32 master shard of each param group lives in host memory; its optimizer state in host
memory (``device: cpu``) or in this rank's swap file (``device: nvme``). The strategy computes the
global gradient norm first, over all the gradient shards where they are (exact clipping needs it
before any update; on one rank the backward folded its sums of squares into the gradients' writes,
``grad_norm.py``), and hands ``update`` the one factor the gradients are multiplied by (average,
unscale, clip). The first bucket's copy to the host starts as the backward ends (``prefetch``: on
a side stream, while the step's norm is summed), so the first update waits less. ``update`` then walks the buckets (``sub_group_size`` elements, at most
``MAX_BUCKET_NUMEL``, and ``buffer_size`` with NVMe) in order; for bucket i:

- its gradient slice is already on the way to the host (the copy of bucket i+1 is started before
  bucket i is updated; non_blocking into pinned memory on CUDA, the slice itself on CPU);
- with NVMe its state was read ahead (``pipeline_read``) while bucket i-1 was updated, and is
  written back behind it (``pipeline_write``), through a ring of ``buffer_count // len(state)``
  bucket buffers;
- the update (``rules``: the fused C kernel for Adam/AdamW, the single-op kernels for Adagrad and
  Lion) also writes the 16-bit copy of the new parameters, which goes back to the device (or is
  written straight into the model's shard on a CPU host) as soon as the bucket is done.

Optimizers without a rule run torch's ``optimizer.step()`` over the whole host shard (CPU offload
only: their state layout is unknown before their first step, so NVMe refuses them).

With ``ratio`` < 1 (stage 3) only the last fraction of each shard is updated here; the first stays
on the device and is updated there after the host buckets (``split.SplitState``).

With NVMe, ``optimizer.state[master]`` holds only the step count between steps; ``state_tensors``
reads the rest back for checkpoints and ``store_loaded`` writes a loaded state out again.

Each step's time beyond the update is split by phase (norm, gradients in, state I/O, write-back;
``phases.py``): ``phases`` is the last step's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.zero.offload.phases import PhaseClock, StepPhases
from dslaunch.runtime.zero.offload.rules import Rule, rule_for
from dslaunch.runtime.zero.offload.split import SplitState
from dslaunch.runtime.zero.offload.swap import Pending, SwapFile, SwapSettings, buffer_slots

__all__ = ["Bucket", "OffloadedStep", "plan_buckets"]

_F32 = 4  # bytes per state element
MAX_BUCKET_NUMEL = 1 << 25
"""Buckets are at most this many elements (128 MiB of fp32), whatever ``sub_group_size`` says.
DeepSpeed's default sub-group (1e9 elements) is the whole shard of a model up to 1B parameters:
one bucket, so nothing of its gradient copy, update and copy back overlaps (a 1.1B model's
offloaded step on an H200 spent 100 ms on top of the 283 ms CPU update), and its two pinned
staging buffers take 8 GB. Smaller buckets pipeline and the result is the same bit for bit
(the update is element-wise)."""


@dataclass(frozen=True)
class Bucket:
    """Elements [lo, hi) of param group ``group``'s shard."""

    group: int
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def plan_buckets(shard_sizes: list[int], bucket_numel: int, starts: list[int] | None = None) -> list[Bucket]:
    """Each group's shard (from ``starts[gi]``, default 0) cut into buckets of at most
    ``bucket_numel`` elements, in order."""
    starts = starts or [0] * len(shard_sizes)
    return [Bucket(gi, lo, min(lo + bucket_numel, n)) for gi, (a, n) in enumerate(zip(starts, shard_sizes, strict=True))
            for lo in range(a, n, bucket_numel)]


class _Staging:
    """Host copies of device tensors, one bucket ahead (pinned memory on an accelerator)."""

    def __init__(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32, count: int = 2):
        self.device = device
        pin = device.type == "cuda"
        self.buffers = [torch.empty(numel, dtype=dtype, pin_memory=pin) for _ in range(count)]
        self.events: list[object | None] = [None] * count

    def buffer(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s buffer (slot ``i % count``)."""
        return self.buffers[i % len(self.buffers)]

    def fetch(self, i: int, src: torch.Tensor) -> torch.Tensor:
        """Start copying ``src`` into bucket ``i``'s buffer; valid after ``ready(i)``."""
        dst = self.buffer(i)[:src.numel()]
        dst.copy_(src, non_blocking=True)
        self.done(i, _record(self.device))
        return dst

    def done(self, i: int, event: object | None) -> None:
        """``event`` marks the end of the copy that uses bucket ``i``'s buffer."""
        self.events[i % len(self.buffers)] = event

    def ready(self, i: int) -> None:
        _wait(self.events[i % len(self.buffers)])


def _record(device: torch.device) -> object | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _wait(event: object | None) -> None:
    if event is not None:
        event.synchronize()


class OffloadedStep:
    """The bucketed update of every group's host master shard (see the module docstring).

    Args:
        groups: the placement's groups (``FlatGroup``/``ShardGroup``: ``master``, ``model_shard``).
        optimizer: the torch optimizer over the masters (one tensor per param group).
        bucket_numel: elements per bucket (``sub_group_size``).
        swap: NVMe settings, or None to keep the state in host memory.
        ratio: the fraction of each shard updated here (stage 3; the rest on the device).

    Raises:
        ConfigError: NVMe or ``ratio`` < 1 with an optimizer that has no rule, too few buffers,
            or a bad ``nvme_path`` (see ``swap.SwapFile``).
    """

    def __init__(self, groups: list, optimizer: torch.optim.Optimizer, bucket_numel: int,
                 swap: SwapSettings | None = None, ratio: float = 1.0):
        self.groups, self.optimizer = groups, optimizer
        bucket_numel = min(bucket_numel, MAX_BUCKET_NUMEL)
        self.rule: Rule | None = rule_for(optimizer)
        self.swap = None
        if swap is not None:
            self.rule = self._nvme_rule(swap)
            bucket_numel = min(bucket_numel, swap.buffer_size)
        sizes = [g.master.numel() for g in groups]
        self.split = None if ratio == 1.0 else SplitState(groups, optimizer, self._split_rule(ratio), ratio)
        self.buckets = plan_buckets(sizes, bucket_numel, self.split.heads if self.split else None)
        self.bucket_numel = max((b.numel for b in self.buckets), default=0)
        device = groups[0].device
        self._staged = device.type != "cpu"
        self._grads = _Staging(self.bucket_numel, device) if self._staged else None
        self._outs: dict[torch.dtype, _Staging] = {}
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # the prefetch's
        self._prefetched: torch.Tensor | None = None  # bucket 0's gradient, copied by ``prefetch``
        self._prefetch_bytes = 0
        self.prefetch_event: object | None = None  # its copy's end (None on the CPU: nothing to copy)
        self.clock = PhaseClock()
        self.phases: StepPhases | None = None  # the last step's, by phase
        if swap is not None:
            keys = self.rule.state_keys
            self._offsets = {}  # (group, key) -> byte offset of that state tensor in the file
            at = 0
            for gi, n in enumerate(sizes):
                for k in keys:
                    self._offsets[gi, k] = at
                    at += n * _F32
            self.swap = SwapFile(swap, at)
            slots = buffer_slots(swap, swap.buffer_count // len(keys), len(self.buckets),
                                 len(keys) * self.bucket_numel * _F32)
            self._ring = [torch.empty(len(keys), self.bucket_numel, dtype=torch.float32) for _ in range(slots)]
            self._writes: list[Pending | None] = [None] * slots
            self._reads: dict[int, list[Pending]] = {}
            # Reading ahead needs a second slot: the next bucket must not land in this one's buffers.
            self._read_ahead = swap.pipeline_read and slots > 1
            self.store_loaded(fresh=True)  # state the optimizer created at construction (Adagrad's sums)

    @property
    def host_numel(self) -> int:
        """Master elements this step updates in host memory (this rank, all groups)."""
        return sum(b.numel for b in self.buckets) if self.rule is not None else sum(g.master.numel() for g in self.groups)

    def _split_rule(self, ratio: float) -> Rule:
        if self.rule is None:
            raise ConfigError(f"{ratio} (partial offload) needs Adam/AdamW (without amsgrad/maximize), Adagrad "
                              f"or Lion; {type(self.optimizer).__name__} is not one of them: set it to 1.0",
                              key="zero_optimization.offload_optimizer.ratio")
        return self.rule

    def _nvme_rule(self, swap: SwapSettings) -> Rule:
        key = "zero_optimization.offload_optimizer"
        if self.rule is None:
            raise ConfigError(f"\"device\": \"nvme\" swaps the state of Adam/AdamW (without amsgrad/"
                              f"maximize), Adagrad and Lion; {type(self.optimizer).__name__} is not one of "
                              "them: use \"device\": \"cpu\"", key=f"{key}.device")
        if swap.buffer_count < len(self.rule.state_keys):
            raise ConfigError(f"{swap.buffer_count} is too few: a bucket of {self.rule.name} takes "
                              f"{len(self.rule.state_keys)} buffers (one per state tensor); "
                              f"use {2 * len(self.rule.state_keys)} or more to pipeline",
                              key=f"{key}.buffer_count")
        return self.rule

    # ----- the step ---------------------------------------------------------------------------
    def prefetch(self, grads: list[torch.Tensor]) -> None:
        """The backward is done (the boundary's ``end_backward``): start the first bucket's copy to
        the host now, on a side stream behind the backward's kernels, so that it runs while the
        step's norm is taken; the update waits for it. On a host (gradients on the CPU) there is
        nothing to copy and the update reads the shard in place: the same bits either way."""
        self._prefetched, self._prefetch_bytes = None, 0
        if self.rule is None or not self.buckets:
            return
        b = self.buckets[0]
        src = grads[b.group][b.lo:b.hi]
        self._prefetched = src
        if self._grads is None or src.device.type == "cpu":
            return
        self._side.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self._side):
            self._grads.fetch(0, src)
            src.record_stream(self._side)
        self.prefetch_event = self._grads.events[0]
        self.clock.grad_bytes += b.numel * src.element_size()

    @property
    def prefetched(self) -> bool:
        """``prefetch`` read the first bucket ahead and no update has taken it yet."""
        return self._prefetched is not None

    def forget_prefetch(self) -> None:
        """The gradients the prefetch copied are gone (``zero_grad``): the next update fetches anew."""
        self._prefetched = None

    def begin(self) -> contextlib.AbstractContextManager:
        """A step starts: the phase clock restarts; returns the phase the caller's norm runs in."""
        self.clock.restart()
        self.clock.grad_bytes = self._prefetch_bytes if self._prefetched is not None else 0
        return self.clock.phase("norm")

    def update(self, grads: list[torch.Tensor], factor: float,
               torch_step: Callable[[list[torch.Tensor], float], None]) -> None:
        """Update every master shard with ``grads * factor``; refresh the model's shards.

        ``grads``: this rank's fp32 gradient shard per group, wherever they are (device or host).
        ``torch_step(host_grads, factor)``: the strategy's ``optimizer.step()`` for optimizers
        without a rule (the masters' ``.grad`` set to ``host_grads``).
        """
        if self.rule is None:
            self._torch_update(grads, factor, torch_step)
        else:
            self._bucket_update(grads, factor)
        self.phases = self.clock.snapshot()

    def _torch_update(self, grads: list[torch.Tensor], factor: float,
                      torch_step: Callable[[list[torch.Tensor], float], None]) -> None:
        with self.clock.phase("grads"):
            host = [t.to("cpu") for t in grads]
        self.clock.grad_bytes += sum(t.numel() * t.element_size() for t in grads if t.device.type != "cpu")
        for g, t in zip(self.groups, host, strict=True):
            g.master.grad = t
        try:
            with self.clock.phase("update"):
                torch_step(host, factor)
        finally:
            for g in self.groups:
                g.master.grad = None
        with self.clock.phase("write_back"):
            for g in self.groups:
                g.copy_master_to_model()

    def _bucket_update(self, grads: list[torch.Tensor], factor: float) -> None:
        rule, clock = self.rule, self.clock
        args = [rule.begin(self.optimizer, gi) for gi in range(len(self.groups))]
        buckets = self.buckets
        pending_out: list[object | None] = []
        if buckets:
            if not self._is_prefetched(buckets[0], grads):
                self._fetch_grad(0, buckets[0], grads)
            self._prefetched = None
            self._read_state(0, buckets[0])
        for i, b in enumerate(buckets):
            g = self.groups[b.group]
            grad = self._grad_ready(i, b, grads)
            if i + 1 < len(buckets):  # the next bucket's transfers overlap this update
                self._fetch_grad(i + 1, buckets[i + 1], grads)
                if self.swap is not None and self._read_ahead:
                    self._read_state(i + 1, buckets[i + 1])
            states = self._state_ready(i, b)
            master = g.master.data[b.lo:b.hi]
            if self.split is not None:  # the master stays with the shard: on a device, a host copy
                host = master.to("cpu")
                with clock.phase("update"):
                    rule.apply(args[b.group], host, grad, states, factor, None)
                if host.data_ptr() != master.data_ptr():
                    with clock.phase("write_back"):
                        master.copy_(host)
            elif getattr(g, "store", None) is not None:  # offload_param nvme: the bucket goes to the file
                with clock.phase("update"):
                    rule.apply(args[b.group], master, grad, states, factor, None)
                with clock.phase("write_back"):
                    g.flat.write(b.lo, master)
                clock.param_bytes += master.numel() * g.dtype.itemsize
            else:
                pending_out.append(self._apply_to_model(i, b, args[b.group], master, grad, states, factor))
            self._write_state(i, b, states)
            if self.swap is not None and not self._read_ahead and i + 1 < len(buckets):
                self._read_state(i + 1, buckets[i + 1])
        with clock.phase("write_back"):
            for event in pending_out:
                _wait(event)
        with clock.phase("state"):
            self._drain()
        if self.split is not None:
            self.split.update_device(args, grads, factor)
            for g in self.groups:
                g.copy_master_to_model()

    def _apply_to_model(self, i: int, b: Bucket, args: dict, master: torch.Tensor, grad: torch.Tensor,
                        states: list[torch.Tensor], factor: float) -> object | None:
        """Update bucket ``b`` and copy it into the model's shard (fused when 16-bit on the host);
        returns the event of a copy to the device still running, or None."""
        model = self.groups[b.group].model_shard[b.lo:b.hi]
        aliased = model.data_ptr() == master.data_ptr()
        out = None
        if not aliased and model.dtype != torch.float32:
            out = model if model.device.type == "cpu" else self._out_buffer(i, model.dtype)[:b.numel]
        with self.clock.phase("update"):
            self.rule.apply(args, master, grad, states, factor, out)
        if aliased or (out is model):  # the update wrote the model's values in its own pass
            return None
        self.clock.param_bytes += model.numel() * model.element_size()
        with self.clock.phase("write_back"):
            if model.device.type != "cpu":
                return self._send(i, model, master if out is None else out)
            model.copy_(master)
        return None

    # ----- gradients in, parameters out -------------------------------------------------------
    def _is_prefetched(self, b: Bucket, grads: list[torch.Tensor]) -> bool:
        """``prefetch`` copied bucket ``b``'s gradient from these very elements."""
        src, pre = grads[b.group][b.lo:b.hi], self._prefetched
        return pre is not None and pre.data_ptr() == src.data_ptr() and pre.numel() == src.numel()

    def _fetch_grad(self, i: int, b: Bucket, grads: list[torch.Tensor]) -> None:
        if self._grads is not None and grads[b.group].device.type != "cpu":
            with self.clock.phase("grads"):
                self._grads.fetch(i, grads[b.group][b.lo:b.hi])
            self.clock.grad_bytes += b.numel * grads[b.group].element_size()

    def _grad_ready(self, i: int, b: Bucket, grads: list[torch.Tensor]) -> torch.Tensor:
        if self._grads is None or grads[b.group].device.type == "cpu":  # on the host already
            return grads[b.group][b.lo:b.hi]
        with self.clock.phase("grads"):
            self._grads.ready(i)
        return self._grads.buffer(i)[:b.numel]

    def _out_buffer(self, i: int, dtype: torch.dtype) -> torch.Tensor:
        staging = self._outs.get(dtype)
        if staging is None:
            staging = self._outs[dtype] = _Staging(self.bucket_numel, self.groups[0].device, dtype)
        staging.ready(i)  # the copy that last used this buffer (two buckets ago) is done
        return staging.buffer(i)

    def _send(self, i: int, model: torch.Tensor, src: torch.Tensor) -> object | None:
        model.copy_(src[:model.numel()], non_blocking=True)
        event = _record(model.device)
        if src.dtype in self._outs:
            self._outs[src.dtype].done(i, event)
        return event

    # ----- NVMe state -------------------------------------------------------------------------
    def _slot(self, i: int) -> torch.Tensor:
        return self._ring[i % len(self._ring)]

    def _read_state(self, i: int, b: Bucket) -> None:
        if self.swap is None:
            return
        k = i % len(self._ring)
        if self._writes[k] is not None:  # the slot's last bucket must be on disk before reuse
            self._writes[k].wait()
            self._writes[k] = None
        buf = self._ring[k]
        self._reads[i] = [self.swap.read(self._offsets[b.group, key] + b.lo * _F32, buf[j, :b.numel])
                          for j, key in enumerate(self.rule.state_keys)]

    def _state_ready(self, i: int, b: Bucket) -> list[torch.Tensor]:
        if self.split is not None:
            return self.split.host_states(b.group, b.lo, b.hi)
        if self.swap is None:
            state = self.optimizer.state[self.groups[b.group].master]
            for key in self.rule.state_keys:
                if key not in state:  # created on first use, as the optimizer would
                    state[key] = torch.zeros_like(self.groups[b.group].master.data)
            return [state[key][b.lo:b.hi] for key in self.rule.state_keys]
        with self.clock.phase("state"):
            for r in self._reads.pop(i):
                r.wait()
        buf = self._slot(i)
        return [buf[j, :b.numel] for j in range(len(self.rule.state_keys))]

    def _write_state(self, i: int, b: Bucket, states: list[torch.Tensor]) -> None:
        if self.swap is None:
            return
        pending = Pending.all([self.swap.write(self._offsets[b.group, key] + b.lo * _F32, t)
                               for key, t in zip(self.rule.state_keys, states, strict=True)])
        if self.swap.settings.pipeline_write:
            self._writes[i % len(self._ring)] = pending
        else:
            pending.wait()

    def _drain(self) -> None:
        for k, w in enumerate(self._writes if self.swap is not None else []):
            if w is not None:
                w.wait()
                self._writes[k] = None

    # ----- checkpoints ------------------------------------------------------------------------
    def state_tensors(self) -> dict[int, dict[str, torch.Tensor]]:
        """NVMe: every group's state tensors read back from the swap file (new host tensors);
        ``ratio`` < 1: both parts joined (new tensors)."""
        if self.split is None and self.swap is None:
            return {}
        return {gi: {k: self.state_tensor(gi, k) for k in self.rule.state_keys} for gi in range(len(self.groups))}

    def state_tensor(self, group: int, key: str) -> torch.Tensor | None:
        """NVMe: state ``key`` of ``group`` read back from the swap file (None: not swapped);
        ``ratio`` < 1: both parts joined."""
        if self.split is not None:
            return self.split.state_tensor(group, key)
        if self.swap is None or (group, key) not in self._offsets:
            return None
        t = torch.empty_like(self.groups[group].master.data)
        self.swap.read(self._offsets[group, key], t).wait()
        return t

    def store_state(self, group: int, key: str, t: torch.Tensor) -> None:
        """NVMe: write ``t``, the whole state ``key`` of ``group`` (as ``state_tensor`` read it), back
        to the swap file.

        Raises:
            ValueError: the state is split between device and host (``ratio`` < 1).
        """
        if self.split is not None or self.swap is None:
            raise ValueError(f"optimizer state {key!r} is split between device and host "
                             "(offload_optimizer.ratio < 1): it cannot be written here")
        self.swap.write(self._offsets[group, key], t.to(torch.float32).contiguous()).wait()

    def store_loaded(self, fresh: bool = False) -> None:
        """NVMe: move the state tensors the optimizer holds (a loaded checkpoint, or state created
        at construction) into the swap file, keeping only the scalars in host memory. Missing
        state is written as zeros, unless ``fresh`` (the reserved file reads as zeros).
        ``ratio`` < 1: into the device and host parts."""
        if self.split is not None:
            self.split.store_loaded()
        if self.swap is None:
            return
        for gi, g in enumerate(self.groups):
            state = self.optimizer.state.get(g.master, {})
            for key in self.rule.state_keys:
                t = state.pop(key, None)
                if t is None and fresh:
                    continue
                if t is None:  # never stepped: zeros, as the optimizer would create
                    t = torch.zeros_like(g.master.data)
                self.swap.write(self._offsets[gi, key], t.to(torch.float32).contiguous()).wait()

    def close(self) -> None:
        """Free the swap file now (it is freed at exit anyway)."""
        if self.swap is not None:
            self.swap.close()
