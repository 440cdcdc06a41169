"""ZeRO's states moved off the accelerator and back between steps: ``engine.offload_states`` and
``engine.reload_states`` (DeepSpeed's ``deepspeed.runtime.zero.offload_states``).

RLHF loops (OpenRLHF, verl) call them between generation and training to free accelerator memory.
The five states (``OffloadStateTypeEnum``): ``lp_params`` (the model weights: the flat buffers of
stages 0-2, stage 3's shards and whole persistent parameters), ``hp_params`` (the fp32 master of a
16-bit model), ``optim_states`` (every tensor of the torch optimizer's state), ``lp_grads`` (the
gradient buffers of the gradient path) and ``contiguous_grad_buffer`` (the reduction buffers of the
bucket reducer, freed and made again when next needed, as DeepSpeed remakes its buckets empty).

Each owner names its tensors as *holders* (an attribute or item holding a tensor: ``FlatGroup.flat``,
each ``param.data``, ``master.data``, a gradient shard in a list, ``optimizer.state[p]["exp_avg"]``):
``FlatGroup.state_holders``, ``ShardGroup.state_holders``, ``GradientPath.grad_holders``. The mover
works on the storages behind them: each storage's bytes are copied to one host buffer (page-locked
with ``pin_memory`` where the storage is on an accelerator), the storage itself is resized to zero
bytes (the accelerator memory really goes, and every view anywhere follows, named or not), and each
holder is pointed at the same elements of the host copy (so ``param.device`` answers ``cpu``, as in
DeepSpeed). ``reload_states`` gives each storage its bytes back, copies the host buffer in and points
the holders at the storage again: the same tensors, the same values, so training continues bitwise
as without the round trip. A storage shared by two states (an fp32 model's master is its weights)
belongs to the first of ``OWNER_ORDER`` that holds it: ``hp_params`` alone then moves nothing, and
``lp_params`` moves the master with the weights. Storages that cannot be resized (host memory
shared between same-host ranks, ``shm.py``) are host memory already and stay.

While a state is offloaded the strategy refuses what would read it (``OffloadedStates.require``): a
forward without ``lp_params``, a backward into offloaded gradients, a step, a checkpoint.

What DeepSpeed refuses is refused alike (``offload_request``): ``offload_param`` configured, an engine
without optimizer, device ``nvme``; with ``offload_optimizer`` the master and optimizer state (and at
stage 3 the gradients) live in host memory already and are left out of ``include``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from dslaunch.errors import UsageError, quote
from dslaunch.runtime.accelerator import get_accelerator
from dslaunch.runtime.zero.config import OffloadDeviceEnum, OffloadStateTypeEnum
from dslaunch.utils.logging import logger

__all__ = ["Holder", "OffloadedStates", "StateOffload", "OWNER_ORDER", "offload_request", "get_state_devices",
           "offload_optimizer_states", "reload_optimizer_states"]

# Which state a storage held by several belongs to (the first holding it).
OWNER_ORDER = (OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.hp_params,
               OffloadStateTypeEnum.optim_states)


@dataclass(frozen=True, eq=False)
class Holder:
    """Where a tensor is held: ``target[key]`` (a list or dict) or ``target.key`` (an attribute).
    ``hide``: set to None while offloaded instead of pointed at the host copy (``param.grad``,
    which torch lets hold only a tensor on its parameter's device)."""

    target: Any
    key: Any
    hide: bool = False

    def get(self) -> Any:
        if isinstance(self.target, (list, dict)):
            return self.target[self.key]
        return getattr(self.target, self.key, None)

    def set(self, value: Any) -> None:
        if isinstance(self.target, (list, dict)):
            self.target[self.key] = value
        else:
            setattr(self.target, self.key, value)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return _storage_key_of(t.untyped_storage())


def _storage_key_of(s: torch.UntypedStorage) -> tuple[str, int]:
    return str(s.device), s.data_ptr()


def _same_elements(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A tensor over ``storage`` with ``t``'s dtype, offset, sizes and strides."""
    return torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, t.storage_offset(), t.size(), t.stride())


@dataclass
class _Moved:
    """One storage moved to host memory: its host copy and the holders pointed at it."""

    storage: torch.UntypedStorage
    host: torch.UntypedStorage
    holders: list[tuple[Holder, torch.Tensor]]  # each holder and its tensor on the storage (geometry)


@dataclass
class OffloadedStates:
    """A strategy's offloaded states and how to bring them back.

    ``collect(state)`` returns the holders of one state (the strategy's ``state_holders``);
    ``free_buffers()`` frees the reduction buffers (``contiguous_grad_buffer``).
    """

    collect: Any
    free_buffers: Any
    moved: dict[OffloadStateTypeEnum, list[_Moved]] = field(default_factory=dict)

    @property
    def offloaded(self) -> set[OffloadStateTypeEnum]:
        return set(self.moved)

    def offload(self, include: Iterable[OffloadStateTypeEnum], pin_memory: bool, non_blocking: bool) -> None:
        """Move each state of ``include`` not already offloaded to host memory (module docstring)."""
        wanted = [s for s in OffloadStateTypeEnum if s in set(include) and s not in self.moved]
        parked = {_storage_key_of(m.host) for moves in self.moved.values() for m in moves}
        # every holder's storage, read before anything moves (a move points holders elsewhere)
        entries = {s: [(h, k) for h in self.collect(s) if _movable(h.get())
                       for k in [_storage_key(h.get())] if k not in parked] for s in OWNER_ORDER}
        owner: dict[tuple[str, int], OffloadStateTypeEnum] = {}
        for state in OWNER_ORDER:
            for _, k in entries[state]:
                owner.setdefault(k, state)
        for state in wanted:
            if state is OffloadStateTypeEnum.contiguous_grad_buffer:
                self.free_buffers()
                self.moved[state] = []
                continue
            keys = [k for k in dict.fromkeys(k for _, k in entries[state]) if owner[k] is state]
            self.moved[state] = [_move_out([h for s in OWNER_ORDER for h, hk in entries[s] if hk == k],
                                           pin_memory, non_blocking) for k in keys]
        _settle(non_blocking)

    def reload(self, non_blocking: bool) -> None:
        """Bring every offloaded state back to where it was (the same storages, the same values)."""
        for moves in self.moved.values():
            for m in moves:
                _move_in(m, non_blocking)
        self.moved.clear()
        if non_blocking:  # the host copies are dropped on return: the copies out of them must be done
            get_accelerator().synchronize()

    def require(self, action: str, states: Iterable[OffloadStateTypeEnum] | None = None) -> None:
        """Raise unless every state of ``states`` (None: all) is in place.

        Raises:
            UsageError: one of them is offloaded.
        """
        out = [s.value for s in self.moved if states is None or s in states]
        if out:
            raise UsageError(f"{action} while ZeRO's {', '.join(out)} are offloaded (engine.offload_states); "
                             "call engine.reload_states() first")

    def devices(self, state: OffloadStateTypeEnum) -> set[torch.device]:
        """Where ``state``'s tensors are now (``get_state_devices``)."""
        return {h.get().device for h in self.collect(state) if torch.is_tensor(h.get()) and h.get().numel() > 0}


def _movable(t: Any) -> bool:
    if not torch.is_tensor(t) or t.device.type == "meta":
        return False
    s = t.untyped_storage()
    return s.nbytes() > 0 and s.resizable()


def _move_out(holders: list[Holder], pin_memory: bool, non_blocking: bool) -> _Moved:
    storage = holders[0].get().untyped_storage()
    pin = pin_memory and storage.device.type != "cpu"
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
    host.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), non_blocking=non_blocking)
    geometry = [(h, h.get()) for h in holders]
    for h, t in geometry:
        h.set(None if h.hide else _same_elements(t, host.untyped_storage()))
    # (freed in stream order: a non-blocking copy out of it is queued first)
    storage.resize_(0)
    return _Moved(storage, host.untyped_storage(), geometry)


def _move_in(m: _Moved, non_blocking: bool) -> None:
    m.storage.resize_(m.host.nbytes())
    device_bytes = torch.empty(0, dtype=torch.uint8, device=m.storage.device).set_(m.storage)
    device_bytes.copy_(torch.empty(0, dtype=torch.uint8).set_(m.host), non_blocking=non_blocking)
    for h, t in m.holders:
        h.set(_same_elements(t, m.storage))


def _settle(non_blocking: bool) -> None:
    accelerator = get_accelerator()
    if not non_blocking:
        accelerator.synchronize()
    gc.collect()
    accelerator.empty_cache()


def offload_request(include: Any, device: Any, offload_optimizer: bool, offload_param: bool,
                    stage: int) -> list[OffloadStateTypeEnum] | None:
    """The states ``offload_states(include, device)`` moves, as DeepSpeed's engine refines them;
    None: nothing to do (device ``none``, with DeepSpeed's warning).

    Raises:
        UsageError: ``offload_param`` is configured, ``device`` is ``nvme`` or unknown, or
            ``include`` names something that is not an ``OffloadStateTypeEnum``.
    """
    if offload_param:
        raise UsageError("engine.offload_states: moving states across devices is not supported with "
                         "zero_optimization.offload_param (the parameters live in host memory already)")
    try:
        device = OffloadDeviceEnum(getattr(device, "value", device))
    except ValueError:
        raise UsageError(f"engine.offload_states(device={quote(device)}): expected OffloadDeviceEnum.cpu") from None
    if device is OffloadDeviceEnum.none:
        logger.warning("No device specified for offloading states.")
        return None
    if device is OffloadDeviceEnum.nvme:
        raise UsageError("engine.offload_states(device=nvme): NVMe is not supported for offloading states; "
                         "use OffloadDeviceEnum.cpu")
    states = list(OffloadStateTypeEnum) if include is None else [_state(s) for s in include]
    if offload_optimizer:  # already in host memory (DeepSpeed's _refine_include_states)
        kept = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
        kept |= {OffloadStateTypeEnum.lp_grads} if stage == 3 else set()
        states = [s for s in states if s not in kept]
    return states


def _state(s: Any) -> OffloadStateTypeEnum:
    try:
        return OffloadStateTypeEnum(getattr(s, "value", s))
    except ValueError:
        valid = ", ".join(e.value for e in OffloadStateTypeEnum)
        raise UsageError(f"engine.offload_states(include=[{quote(s)}]): expected OffloadStateTypeEnum members "
                         f"({valid})") from None


def optimizer_holders(optimizer: torch.optim.Optimizer) -> list[Holder]:
    """Every tensor of a torch optimizer's state (``optim_states``)."""
    return [Holder(state, k) for state in optimizer.state.values() for k, v in state.items() if torch.is_tensor(v)]


def get_state_devices(model: Any, state: OffloadStateTypeEnum) -> set[torch.device]:
    """The devices ``state``'s tensors of ``model`` (a ``DeepSpeedEngine``) are on now, as
    DeepSpeed's; ``contiguous_grad_buffer`` offloaded: none (the buffers are freed).

    Args:
        model: the engine.
        state: which state.

    Returns:
        A set of devices.
    """
    return model.zero.state_devices(_state(state))


def offload_optimizer_states(optimizer: torch.optim.Optimizer, device: Any, pin_memory: bool = False,
                             non_blocking: bool = False) -> None:
    """Move every tensor of ``optimizer.state`` to ``device`` (DeepSpeed's helper: pinned host
    memory with ``pin_memory`` where it comes from an accelerator)."""
    for h in optimizer_holders(optimizer):
        t = h.get()
        pin = pin_memory and t.device.type != "cpu"
        h.set(t.to(getattr(device, "value", device), non_blocking=non_blocking)
              if not pin else torch.empty_like(t, device="cpu").pin_memory().copy_(t, non_blocking=non_blocking))


def reload_optimizer_states(optimizer: torch.optim.Optimizer, device: Any, non_blocking: bool = False
                            ) -> list[torch.Tensor]:
    """Move every tensor of ``optimizer.state`` back to ``device``; returns the host tensors
    replaced (keep them until the accelerator synchronizes when ``non_blocking``)."""
    hosts = []
    for h in optimizer_holders(optimizer):
        hosts.append(h.get())
        h.set(hosts[-1].to(device, non_blocking=non_blocking))
    return hosts


class StateOffload:
    """The strategy's side of ``offload_states``/``reload_states`` (a ``ZeroStrategy`` base): the
    holders of each state, read from the placement's groups, the gradient paths and the optimizer."""

    stage: int
    comm: Any
    offload: Any  # offload_optimizer's step (``offload.step.OffloadedStep``), or None
    groups: list[Any]
    parts: list[Any]
    optimizer: torch.optim.Optimizer

    @property
    def _states(self) -> OffloadedStates:
        if "_offloaded_states" not in self.__dict__:
            self.__dict__["_offloaded_states"] = OffloadedStates(self.state_holders, self._free_reduce_buffers)
        return self.__dict__["_offloaded_states"]

    def offload_states(self, include: Any = None, device: Any = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move ``include`` (None: every state) to host memory (module docstring); a state
        already offloaded stays so.

        Raises:
            UsageError: see ``offload_request``.
        """
        states = offload_request(include, device, self.comm.offload_optimizer, self.comm.offload_param, self.stage)
        if states is None:
            return
        # Nothing may still write or read the storages about to be emptied: the parameter publish
        # (overlap_param_gather), offload_optimizer's read-ahead of the gradients (side stream).
        self.synchronize()
        if self.offload is not None:
            self.offload.forget_prefetch()
        get_accelerator().synchronize()
        self.release_gathered(persistent=True)  # stage 3: DeepSpeed empties the partition cache too
        self._states.offload(states, pin_memory, non_blocking)
        self._refuse_gradients()

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring every offloaded state back (a no-op when none is)."""
        self._states.reload(non_blocking)
        self._refuse_gradients()

    def state_holders(self, state: OffloadStateTypeEnum) -> list[Holder]:
        """Where ``state``'s tensors are held (the module docstring)."""
        if state in (OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.hp_params):
            return [h for g in self.groups for h in g.state_holders()[state.value]]
        if state is OffloadStateTypeEnum.lp_grads:
            return [h for part in self.parts for h in part.gradients.grad_holders()]
        if state is OffloadStateTypeEnum.optim_states:
            return optimizer_holders(self.optimizer)
        return []  # contiguous_grad_buffer: the reducer's pool, freed rather than moved

    def state_devices(self, state: OffloadStateTypeEnum) -> set[torch.device]:
        """Where ``state``'s tensors are (``get_state_devices``); the reduction buffers: where they
        are made, none while offloaded."""
        if state is OffloadStateTypeEnum.contiguous_grad_buffer:
            return set() if state in self._states.offloaded else {g.device for g in self.groups}
        return self._states.devices(state)

    def synchronize(self) -> None:
        """Wait for in-flight parameter gathers (``ZeroStrategy.synchronize``)."""

    def release_gathered(self, persistent: bool = False) -> None:
        """Release the whole parameters stage 3 gathered (``ZeroStrategy.release_gathered``)."""

    def _require(self, action: str, *states: OffloadStateTypeEnum) -> None:
        """Raise ``UsageError`` if one of ``states`` (none named: every state but the reduction
        buffers, which are made again on use) is offloaded."""
        if "_offloaded_states" in self.__dict__:
            every = [s for s in OffloadStateTypeEnum if s is not OffloadStateTypeEnum.contiguous_grad_buffer]
            self._states.require(action, states or every)

    def _require_weights(self, action: str) -> None:
        self._require(action, OffloadStateTypeEnum.lp_params)

    def _free_reduce_buffers(self) -> None:
        for part in self.parts:
            part.gradients.reducer.pool.clear()

    def _refuse_gradients(self) -> None:
        """A backward writing into offloaded gradients (or weights) fails in its hook, not in memory."""
        out = self._states.offloaded & {OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.lp_params}
        for part in self.parts:
            part.gradients.refusal = (None if not out else
                                      f"backward while ZeRO's {', '.join(sorted(s.value for s in out))} are "
                                      "offloaded (engine.offload_states); call engine.reload_states() first")
