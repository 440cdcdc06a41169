"""A param group's flat storage: the module's parameters become views into one buffer.

The model weights, the gradient buffer (laid out alike) and, for an fp32 model, the master shard
are the same memory; a 16-bit model gets a separate fp32 master of this rank's range. The layout
(offsets, this rank's range, padding) is ``partition.GroupLayout``.

The whole group is allocated (``layout.padded`` elements) on every rank; stage 3's storage, which
holds only this rank's shard, is ``partitioned.ShardGroup``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dslaunch.runtime.zero.offload_states import Holder
from dslaunch.runtime.zero.partition import GroupLayout

__all__ = ["FlatGroup", "group_dtype", "to_host"]


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` in host memory (``t`` itself when it is there already: an fp32 master on a CPU host
    still aliases the model); page-locked with ``pin`` when it comes from an accelerator."""
    if t.device.type == "cpu":
        return t
    host = t.to("cpu")
    return host.pin_memory() if pin else host


def group_dtype(params: list[torch.nn.Parameter]) -> torch.dtype:
    """The one dtype of a param group's parameters.

    Raises:
        TypeError: the group mixes dtypes.
    """
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise TypeError(f"a param group mixes dtypes {sorted(map(str, dtypes))}; "
                        "cast the model to one dtype before initialize()")
    return params[0].dtype


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


class FlatGroup:
    """One param group's flat storage: parameters re-pointed into a single contiguous buffer.

    ``flat`` (model dtype, ``layout.padded`` elements) holds the weights; each parameter's
    ``.data`` is a view into it. ``master`` is this rank's fp32 shard (a view of ``flat`` when the
    model is fp32, a separate copy otherwise; in host memory with ``offload``), wrapped as the
    Parameter the optimizer updates. ``alloc(numel, dtype, device)`` makes ``flat`` (None:
    ``torch.empty``; the shared-memory publish passes one in shared memory).
    """

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], hparams: dict,
                 world_size: int, rank: int, partitioned: bool, offload: bool = False, pin: bool = False,
                 alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None):
        self.params = params
        self.hparams = hparams
        self.dtype = group_dtype(params)
        self.layout = GroupLayout.build(names, [tuple(p.shape) for p in params], world_size, rank,
                                        partitioned)
        lay = self.layout
        # empty, not zeros: pages are touched as each param moves in and its old storage is freed,
        # so flattening never holds two copies of the model (peak RSS).
        self.flat = (alloc or _empty)(lay.padded, self.dtype, params[0].device)
        self.flat[lay.numel:].zero_()
        for i, p in enumerate(params):
            a, b = lay.param_range(i)
            self.flat[a:b].copy_(p.data.reshape(-1))
            p.data = self.flat[a:b].view(p.shape)
        own = self.flat[lay.start:lay.end]
        data = own if self.dtype == torch.float32 else own.float()
        data = to_host(data, pin) if offload else data
        # nn.Parameter aliases ``data``: in fp32 the optimizer updates the model weights in place.
        self.master = torch.nn.Parameter(data, requires_grad=False)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def device(self) -> torch.device:
        return self.flat.device

    @property
    def model_shard(self) -> torch.Tensor:
        """This rank's range of the model weights (model dtype, where the model is)."""
        return self.flat[self.layout.start:self.layout.end]

    def load_full(self, values: torch.Tensor) -> bool:
        """Write the whole group's weights (``numel`` elements); True: the model now holds them all."""
        self.flat[:self.layout.numel].copy_(values)
        return True

    def param_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` (laid out like ``flat``) shaped like each parameter."""
        return [buffer[a:b].view(s) for (a, b), s in
                zip(map(self.layout.param_range, range(len(self.params))), self.layout.shapes, strict=True)]

    def copy_master_to_model(self) -> None:
        """Write the fp32 master shard into this rank's slice of the model weights."""
        if not self._master_aliases_model():
            self.flat[self.layout.start:self.layout.end].copy_(self.master.data)

    def copy_model_to_master(self) -> None:
        """Read this rank's slice of the model weights into the fp32 master shard."""
        if not self._master_aliases_model():
            self.master.data.copy_(self.flat[self.layout.start:self.layout.end])

    def state_holders(self) -> dict[str, list[Holder]]:
        """This group's tensors by ``offload_states`` state: ``lp_params`` the flat weights and each
        parameter, ``hp_params`` the master (the same storage as the weights for an fp32 model)."""
        return {"lp_params": [Holder(self, "flat"), *(Holder(p, "data") for p in self.params)],
                "hp_params": [Holder(self.master, "data")]}

    def _master_aliases_model(self) -> bool:
        return self.master.data.data_ptr() == self.flat.data_ptr() + self.layout.start * self.flat.element_size()
