"""Partial offload (``offload_optimizer.ratio`` < 1, stage 3): ZeRO-Offload++'s "twin flow".

Each param group's shard of ``n`` elements is cut as DeepSpeed cuts its sub-groups: the first
``int((1 - ratio) * n)`` elements stay on the compute device, the rest (the last ``ratio`` of the
shard) go to the host. DeepSpeed rounds to whole sub-groups (``sub_group_size``) counted over all
groups; dslaunch cuts each group's shard at an element, so the fraction holds with the default
``sub_group_size`` (1e9: one sub-group, which DeepSpeed would put wholly on one side).

- The optimizer state of the host part lives in host memory, that of the device part on the
  device; both are kept here (``optimizer.state[master]`` holds only the step count between
  steps, as with NVMe), and ``state_tensor`` joins them for checkpoints, so the format is the
  same whichever side a tensor lives on.
- The host part is updated by the offloaded step, bucket by bucket, with the CPU kernels; the
  device part by the same rule's kernel for the device (``dslaunch.kernels``: the reference, or
  Triton on CUDA), after the host buckets.
- Limitation: the fp32 master stays whole with the shard (for an fp32 model it *is* the shard);
  on an accelerator each host bucket's master slice is copied to the host and back (blocking).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.runtime.zero.offload.rules import Rule

__all__ = ["SplitState", "device_numel"]


def device_numel(numel: int, ratio: float) -> int:
    """Elements of a shard of ``numel`` that stay on the device (the first ones), DeepSpeed's rule."""
    return int((1.0 - ratio) * numel)


class SplitState:
    """Every group's optimizer state, cut at ``heads[gi]``: device part first, host part after.

    Args:
        groups: the placement's groups (``master`` on the compute device).
        optimizer: the optimizer over the masters; the state it created at construction
            (Adagrad's sums) is moved here.
        rule: the update of a slice (its ``state_keys`` are what is kept here).
        ratio: the fraction of each shard on the host, in (0, 1).
    """

    def __init__(self, groups: list, optimizer: torch.optim.Optimizer, rule: Rule, ratio: float):
        self.groups, self.optimizer, self.rule = groups, optimizer, rule
        self.heads = [device_numel(g.master.numel(), ratio) for g in groups]
        host = torch.device("cpu")
        self.device_state = [{k: torch.zeros(h, device=g.master.device) for k in rule.state_keys}
                             for g, h in zip(groups, self.heads, strict=True)]
        self.host_state = [{k: torch.zeros(g.master.numel() - h, device=host) for k in rule.state_keys}
                           for g, h in zip(groups, self.heads, strict=True)]
        self.store_loaded()

    def host_states(self, group: int, lo: int, hi: int) -> list[torch.Tensor]:
        """Slices [lo, hi) (shard offsets, in the host part) of ``group``'s host state."""
        h = self.heads[group]
        return [self.host_state[group][k][lo - h:hi - h] for k in self.rule.state_keys]

    def update_device(self, args: list[dict[str, Any]], grads: list[torch.Tensor], factor: float) -> None:
        """The device part of every group, with the rule's kernel for the device."""
        for gi, (g, h) in enumerate(zip(self.groups, self.heads, strict=True)):
            if h:
                states = [self.device_state[gi][k] for k in self.rule.state_keys]
                self.rule.apply(args[gi], g.master.data[:h], grads[gi][:h], states, factor, None)

    def state_tensor(self, group: int, key: str) -> torch.Tensor | None:
        """State ``key`` of ``group``, both parts joined on the master's device (a new tensor)."""
        if key not in self.device_state[group]:
            return None
        device = self.groups[group].master.device
        return torch.cat([self.device_state[group][key], self.host_state[group][key].to(device)])

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in (self.device_state, self.host_state)
                   for st in part for t in st.values())

    def store_loaded(self) -> None:
        """Move the state tensors the optimizer holds (a loaded checkpoint, or state created at
        construction) into the two parts; missing state becomes zeros, as the optimizer would create."""
        for gi, g in enumerate(self.groups):
            state = self.optimizer.state.get(g.master, {})
            h = self.heads[gi]
            for key in self.rule.state_keys:
                t = state.pop(key, None)
                if t is None:
                    self.device_state[gi][key].zero_()
                    self.host_state[gi][key].zero_()
                    continue
                t = t.reshape(-1)
                self.device_state[gi][key].copy_(t[:h])
                self.host_state[gi][key].copy_(t[h:])
