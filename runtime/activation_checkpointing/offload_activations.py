"""ALST's offload of checkpointed hidden states to host memory (DeepSpeed's
``deepspeed.runtime.activation_checkpointing.offload_activations``).

With gradient checkpointing on, what a decoder keeps from its forward until backward is, per
layer, the input of the checkpointed call: the hidden states, ``[batch, sequence, hidden]``
(torch's checkpoint saves the call's inputs for the recompute, reentrant or not). At long
sequences these ``layers x batch x sequence x hidden`` values are most of the activation memory
left; ALST moves each to host memory as the forward leaves its layer and brings it back when
backward reaches the layer.

``CheckpointHiddenStatesOffload`` is a ``saved_tensors_hooks`` context. While one is active, a
Hugging Face ``GradientCheckpointingLayer`` that checkpoints (training, grad enabled,
``gradient_checkpointing`` on) marks its first argument; when the checkpoint saves that tensor the
pack hook copies it to host memory (pinned where there is a GPU, without blocking) and the saved
graph holds the host copy instead; unpacking in backward copies it back. Every other saved tensor
passes through untouched. The newest ``keep_last_count`` marked tensors stay where they are until a
newer one arrives: backward needs the last layer's input first. A saved value holds its own host
copy, so backward may run after the context has closed (the engine closes it after the forward).

Code that checkpoints without transformers' layer can mark the tensor it checkpoints itself:
``active()`` is the innermost open context (or None), ``mark(t)`` before the checkpoint call.

Global state: the marker is a wrapper around ``GradientCheckpointingLayer.__call__``, installed
while any context is open (counted) and removed when the last closes, as DeepSpeed does; the open
contexts are a per-thread stack.

Differences from DeepSpeed: copies run on the current stream (non-blocking into pinned memory),
not a side stream with a buffer pool, so ``use_streams``, ``max_fwd_stash_count`` and
``max_cpu_buffer_pool_count`` are validated and change nothing; a tensor already in host memory
(a CPU-only run) is still copied: the saved graph then stops holding the original, which is what
the tests measure (DeepSpeed skips non-accelerator tensors).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from dslaunch.errors import UsageError

__all__ = ["CheckpointHiddenStatesOffload", "CheckpointActivationOffloadStats",
           "get_checkpoint_hidden_states_offloading_ctx_manager", "active"]


@dataclass
class CheckpointActivationOffloadStats:
    """Counts since the context was entered (DeepSpeed's fields)."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


class _Held:
    """One saved marked tensor: on its device until offloaded, then a host copy."""

    __slots__ = ("device", "host", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.device = tensor.device

    def offload(self, pin: bool) -> int:
        t = self.tensor
        if t is None:
            return 0
        pin = pin and t.device.type != "cpu" and torch.cuda.is_available()
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
        self.host = host.copy_(t.detach(), non_blocking=pin)
        self.tensor = None  # the graph no longer holds the device tensor
        return host.numel() * host.element_size()

    def restore(self) -> tuple[torch.Tensor, bool]:
        """The tensor on its device, and whether it was copied back."""
        if self.tensor is not None:
            return self.tensor, False
        assert self.host is not None
        return self.host.to(self.device, non_blocking=self.host.is_pinned()), True


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """Offload the hidden states checkpointed layers save, while the context is open (see the
    module's docstring). Arguments as DeepSpeed's:

    Args:
        use_pin_memory: pin the host copies (where there is a GPU): non-blocking copies.
        use_streams, max_fwd_stash_count, max_cpu_buffer_pool_count: DeepSpeed's side-stream
            tuning; validated, no effect (see Differences).
        min_offload_bytes: marked tensors smaller than this stay where they are.
        keep_last_count: the newest marked tensors left in place (backward needs them first).

    Raises:
        UsageError: a negative count or byte threshold; entering one instance twice.
    """

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1) -> None:
        for name, value in (("min_offload_bytes", min_offload_bytes), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("keep_last_count", keep_last_count)):
            if not isinstance(value, int) or value < 0:
                raise UsageError(f"CheckpointHiddenStatesOffload({name}={value!r}): must be an integer >= 0")
        self.use_pin_memory, self.use_streams = bool(use_pin_memory), bool(use_streams)
        self.min_offload_bytes, self.keep_last_count = min_offload_bytes, keep_last_count
        self.max_fwd_stash_count, self.max_cpu_buffer_pool_count = max_fwd_stash_count, max_cpu_buffer_pool_count
        self.stats = CheckpointActivationOffloadStats()
        self._marks: dict[int, int] = {}
        self._recent: deque[_Held] = deque()
        super().__init__(self._pack, self._unpack)

    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when the next checkpoint saves it."""
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _unmark(self, tensor: torch.Tensor) -> bool:
        count = self._marks.pop(id(tensor), 0)
        if count > 1:
            self._marks[id(tensor)] = count - 1
        return count > 0

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors_seen += 1
        if not self._unmark(tensor):
            return tensor
        if (tensor.numel() * tensor.element_size() < self.min_offload_bytes or isinstance(tensor, torch.nn.Parameter)
                or (tensor.numel() > 1 and 0 in tensor.stride())):  # a broadcast view: no dense copy of it
            self.stats.skipped_marked_tensors += 1
            return tensor
        held = _Held(tensor)
        self._recent.append(held)
        while len(self._recent) > self.keep_last_count:
            self._offload(self._recent.popleft())
        return held

    def _offload(self, held: _Held) -> None:
        n = held.offload(self.use_pin_memory)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += n

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Held):
            return saved
        tensor, copied = saved.restore()
        if copied:
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += tensor.numel() * tensor.element_size()
        else:
            self.stats.kept_last_tensors += 1
        return tensor

    def reset(self) -> None:
        """Zero the counts and forget marks nothing saved (DeepSpeed's ``reset``)."""
        self.stats = CheckpointActivationOffloadStats()
        self._marks.clear()
        self._recent.clear()

    def __enter__(self) -> CheckpointHiddenStatesOffload:
        stack = _stack()
        if self in stack:
            raise UsageError("CheckpointHiddenStatesOffload is not re-entrant: open another instance to nest one")
        self.reset()
        _MARKER.install()
        stack.append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _stack().remove(self)
        _MARKER.uninstall()
        # the newest kept tensors stay in place: backward reads them first; saved values own
        # their data, so nothing here must outlive the context
        self._marks.clear()
        self._recent.clear()


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A new ``CheckpointHiddenStatesOffload`` (DeepSpeed's factory; the same arguments)."""
    return CheckpointHiddenStatesOffload(use_pin_memory, use_streams, min_offload_bytes, max_fwd_stash_count,
                                         max_cpu_buffer_pool_count, keep_last_count)


_LOCAL = threading.local()


def _stack() -> list[CheckpointHiddenStatesOffload]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def active() -> CheckpointHiddenStatesOffload | None:
    """The innermost open context on this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


class _Marker:
    """The wrapper around ``GradientCheckpointingLayer.__call__`` that marks the hidden states of a
    checkpointing layer while a context is open (installed once for all open contexts)."""

    def __init__(self) -> None:
        self.users = 0
        self.lock = threading.Lock()
        self.layer: Any = None
        self.owned: Any = None  # the class's own __call__ before ours (None: inherited)

    def install(self) -> None:
        with self.lock:
            self.users += 1
            if self.users > 1:
                return
            try:
                from transformers import GradientCheckpointingLayer
            except ImportError:  # no transformers: only code that marks itself is offloaded
                return
            self.layer, self.owned = GradientCheckpointingLayer, GradientCheckpointingLayer.__dict__.get("__call__")
            GradientCheckpointingLayer.__call__ = _marking(GradientCheckpointingLayer.__call__)

    def uninstall(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users or self.layer is None:
                return
            if self.owned is None:
                del self.layer.__call__
            else:
                self.layer.__call__ = self.owned
            self.layer = self.owned = None


_MARKER = _Marker()


def _marking(call: Any) -> Any:
    def marked_call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        manager = active()
        hidden = args[0] if args and torch.is_tensor(args[0]) else None
        if (manager is None or hidden is None or not layer.training or not torch.is_grad_enabled()
                or not getattr(layer, "gradient_checkpointing", False)):
            return call(layer, *args, **kwargs)
        manager.mark(hidden)
        try:
            return call(layer, *args, **kwargs)
        finally:
            manager._unmark(hidden)  # a mark the checkpoint did not use must not match a later tensor's id

    return marked_call
