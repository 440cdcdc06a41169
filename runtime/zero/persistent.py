"""Stage 3's persistent parameters released by ``engine.empty_partition_cache()`` until next used.

DeepSpeed's ``empty_partition_cache`` releases every parameter, the persistent ones (at most
``stage3_param_persistence_threshold`` elements, kept whole on every rank) included, and gathers
them again at their next use. ``ReleasedPersistent`` does the same: ``release`` puts them back to
placeholders (``ds_status`` ``NOT_AVAILABLE``, 0 elements), and they are made whole again, all at
once, by whichever comes first: the engine's next forward or step (``restore``), or the forward
pre-hook of a module using one (a direct ``engine.module(...)`` call or ``generate``). How they
are made whole is the owner's (``remake``: stage 3's re-gather from the shards, or views of a
resident shard; a forward-only engine's gather).

collective: ``restore`` (and so the first forward after a release) gathers on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dslaunch.runtime.zero import params as zp
from dslaunch.runtime.zero.fetcher import module_params

__all__ = ["ReleasedPersistent"]


class ReleasedPersistent:
    """The persistent parameters an ``empty_partition_cache`` released (none at first).

    Args:
        module: the model whose modules' forward pre-hooks restore them (None: only ``restore``).
        remake: makes the given released parameters whole again (collective).
    """

    def __init__(self, module: torch.nn.Module | None, remake: Callable[[list[torch.nn.Parameter]], None]):
        self.module, self.remake = module, remake
        self.params: list[torch.nn.Parameter] = []
        self._hooks: list[Any] = []

    def release(self, params: list[torch.nn.Parameter]) -> None:
        """Release every whole, unused persistent parameter of ``params`` (each rank alike)."""
        for p in params:
            if (zp.is_partitioned(p) and p.ds_persist and p.ds_status is zp.ZeroParamStatus.AVAILABLE
                    and p._dsl_users <= 0 and all(p is not q for q in self.params)):
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.ds_status = zp.ZeroParamStatus.NOT_AVAILABLE
                self.params.append(p)
        if self.params and self.module is not None and not self._hooks:
            ids = {id(p) for p in self.params}
            self._hooks = [m.register_forward_pre_hook(self._before_forward) for m in self.module.modules()
                           if any(id(p) in ids for p in module_params(m))]

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.restore()

    def restore(self) -> None:
        """Make the released parameters whole again (a no-op when none is). collective."""
        if not self.params:
            return
        self.remake(self.params)  # (if it raises, they stay released and hooked)
        for h in self._hooks:
            h.remove()
        self.params, self._hooks = [], []
