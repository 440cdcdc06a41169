"""Stage 3's placement: the module's parameters are partitioned too, not only the optimizer state.

``ShardGroup`` is stage 3's ``flat.FlatGroup``: the same ``GroupLayout`` as stages 1/2 (so the
optimizer, the gradient path, checkpoints and resharding see no difference), but it stores only
this rank's ``[start, end)`` of the group's flat vector. Each parameter becomes a range of that
vector (``params.attach``): ``param.data`` is an empty placeholder until something gathers it.
Parameters of at most ``param_persistence_threshold`` elements stay whole on every rank
(``ds_persist``) and are re-gathered after each step (``publish``).

With ``offload_param`` the shard lives in host memory (gathers copy each rank's own piece up to the
device); with ``offload_optimizer`` the fp32 master and the optimizer state do (with ``ratio`` < 1
only the last fraction of the state, ``offload.split``; the master stays with the shard). With
``offload_param.device: nvme`` the shard lives in a swap file (``offload.param_store.ShardStore``,
all but ``max_in_cpu`` elements): ``shard`` is then a meta tensor, every access goes through
``flat.read``/``flat.write``, and the fp32 master (host memory) is a separate copy even for an
fp32 model.

Resident groups: where the shard is the whole vector and lives where the parameters are used (one
rank in the shard group, no ``offload_param`` to another device, no NVMe, no ZeRO++ gather) there
is nothing to gather: every parameter is a view of the shard, whole all along (``ds_persist``), and
stays so; no gather, release or publish ever runs for it and the optimizer's update of the shard
(or the master's copy into it) is the parameters' update. Stage 3 then hooks nothing (``stage3.py``).

Same-host ranks (``shared_memory_collectives``, ``shm.py``): each rank's shard is its slot of one
shared segment (``params.SharedShards``), so a gather reads the owners' shards directly, waiting
for nobody; a parameter inside one owner's shard is gathered as a view of it (no copy, no memory).
Where the shard lives elsewhere (``offload_param``, another device) gathers go through the
shared-memory slots (``params.SharedMemoryGather``).

Parameters built under ``zero.Init`` arrive already partitioned (alone); each is gathered once
here, on every rank, to copy this rank's part into the group shard: one parameter at a time, so
building the engine never holds the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.zero import params as zp
from dslaunch.runtime.zero.flat import group_dtype, to_host
from dslaunch.runtime.zero.offload.param_store import ShardStore
from dslaunch.runtime.zero.offload_states import Holder
from dslaunch.runtime.zero.partition import GroupLayout, shard_slot
from dslaunch.runtime.zero.placement import Placement, sum_over_ranks
from dslaunch.runtime.zero.shm import SharedMemoryCollectives, SharedTensors
from dslaunch.runtime.zero.specs import CommSettings, GroupSpec, group_numel, largest_piece
from dslaunch.runtime.zero.zeropp import build_gathers

__all__ = ["ShardGroup", "Partitioned"]


def _full_value(p: torch.nn.Parameter) -> torch.Tensor:
    """The whole value of ``p`` as a flat tensor (collective if ``zero.Init`` partitioned it)."""
    if not zp.is_partitioned(p) or p.ds_status is zp.ZeroParamStatus.AVAILABLE:
        return p.data.reshape(-1)
    buf, works = zp.gather_range(p._dsl_flat, p._dsl_offset, p._dsl_offset + p.ds_numel)
    wait_all(works, "parameter gather (broadcast)")
    return buf


class ShardGroup:
    """One param group's storage at stage 3: this rank's shard of the flat vector, nothing more.

    ``shard`` (model dtype, ``end - start`` elements) holds the weights this rank owns; ``master``
    is its fp32 copy, the Parameter the optimizer updates (the shard itself for an fp32 model).

    collective: construct on all ranks.
    """

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], hparams: dict,
                 world_size: int, rank: int, process_group: Any, comm: CommSettings, in_cpu: int = 0,
                 gatherer: Any = None):
        self.params, self.hparams = params, hparams
        self.dtype = group_dtype(params)
        shapes = [tuple(p.ds_shape) if zp.is_partitioned(p) else tuple(p.shape) for p in params]
        self.layout = lay = GroupLayout.build(names, shapes, world_size, rank, True)
        self.compute_device = params[0].device
        home = torch.device("cpu") if comm.offload_param else self.compute_device
        if isinstance(gatherer, zp.SharedShards):  # the shard is this rank's slot of the shared segment
            self.shard = gatherer.buffers.mine[:lay.end - lay.start]
        else:
            self.shard = torch.empty(lay.end - lay.start, dtype=self.dtype, device=home)
        if comm.offload_param and comm.pin_memory and self.compute_device.type != "cpu":
            self.shard = self.shard.pin_memory()
        whole = []
        for i, p in enumerate(params):
            a, b = lay.param_range(i)
            full = _full_value(p)
            lo, hi = max(a, lay.start), min(b, lay.end)
            if hi > lo:
                self.shard[lo - lay.start:hi - lay.start].copy_(full[lo - a:hi - a])
            whole.append(full if b - a <= comm.param_persistence_threshold else None)
        data = self.shard if self.dtype == torch.float32 else self.shard.float()
        # Partial offload (ratio < 1) keeps the master where the shard is: offload.split streams
        # the host part's slices through host memory (see its docstring).
        whole_host = comm.offload_optimizer and comm.offload_ratio == 1.0
        data = to_host(data, comm.pin_memory) if whole_host else data
        self.master = torch.nn.Parameter(data, requires_grad=False)
        self.store = None
        if comm.param_nvme is not None:  # the shard moves to the swap file; the master stays
            self.store = ShardStore(comm.param_nvme, self.shard.numel(), self.dtype, in_cpu,
                                    comm.pin_memory and self.compute_device.type != "cpu")
            self.store.write(0, self.shard)
            self.shard = torch.empty(self.shard.shape, dtype=self.dtype, device="meta")
        aliased = self.store is None and self.master.data.data_ptr() == self.shard.data_ptr()
        # the shard is the whole vector, where the parameters are used: they can be views of it
        self.resident = (world_size == 1 and self.store is None and gatherer is None
                         and self.shard.device == self.compute_device)
        self.flat = zp.FlatShard(self.shard, lay.numel, world_size, rank, process_group,
                                 None if aliased else self.master.data, self.compute_device, self.store,
                                 gatherer)
        for i, (p, full) in enumerate(zip(params, whole, strict=True)):
            if self.resident:
                a, b = lay.param_range(i)
                p.data = self.shard[a - lay.start:b - lay.start].view(shapes[i])
            elif full is not None:
                p.data = full.to(self.dtype).view(shapes[i]).clone()
            p._dsl_users = 0
            zp.attach(p, self.flat, lay.offsets[i], torch.Size(shapes[i]),
                      persist=self.resident or full is not None)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def device(self) -> torch.device:
        """Where the parameters are used and their gradients reduced."""
        return self.compute_device

    @property
    def model_shard(self) -> torch.Tensor:
        """This rank's range of the model weights: the shard itself (with NVMe: read from the file
        into a new host tensor; write with ``flat.write``)."""
        return self.shard if self.store is None else self.store.read_all()

    @property
    def persistent(self) -> list[torch.nn.Parameter]:
        """The whole copies a step must refresh (a resident group's parameters are the shard)."""
        return [] if self.resident else [p for p in self.params if p.ds_persist]

    def state_holders(self) -> dict[str, list[Holder]]:
        """This group's tensors by ``offload_states`` state: ``lp_params`` the shard (and each
        parameter's ``ds_tensor`` view of it) and the whole persistent parameters, ``hp_params``
        the fp32 master (the shard itself for an fp32 model). (``flat``'s own references follow the
        storage: only the engine's code reads them, and it refuses to while they are offloaded.)"""
        lp = [Holder(self, "shard"), *(Holder(p, attr) for p in self.params for attr in ("ds_tensor", "data"))]
        return {"lp_params": lp, "hp_params": [Holder(self.master, "data")]}

    def make_whole(self, params: list[torch.nn.Parameter]) -> None:
        """Persistent ``params`` released by ``empty_partition_cache``, whole again: views of the
        shard in a resident group; elsewhere new memory that the placement's ``publish`` fills."""
        for p in params:
            p.data = (p.ds_tensor.view(p.ds_shape) if self.resident
                      else torch.empty(p.ds_shape, dtype=self.dtype, device=self.compute_device))
            p.ds_status = zp.ZeroParamStatus.AVAILABLE

    def copy_master_to_model(self) -> None:
        if self.flat.master is not None:
            self.flat.write(0, self.master.data)

    def copy_model_to_master(self) -> None:
        if self.flat.master is not None:
            self.flat.read(0, self.shard.numel(), self.master.data)

    def load_full(self, values: torch.Tensor) -> bool:
        """The shard is written from the master; whole (persistent) parameters need a publish."""
        return False


class Partitioned(Placement):
    """Rank r holds ``partition_range(numel, world, r)`` of each group's parameters, master and
    optimizer state (stage 3). ``publish`` refreshes the persistent parameters after a step; the
    others are gathered when a module needs them."""

    partitioned = True
    always_norm = True

    def _build_groups(self, specs: list[GroupSpec], comm: CommSettings) -> list[Any]:
        groups, in_cpu = [], comm.param_in_cpu  # max_in_cpu counts over this rank's groups, in order
        gathers = build_gathers(comm, self.pg, [_vector(g.params) for g in specs])
        if not any(gathers):  # no ZeRO++: same-host ranks gather through shared memory
            gathers = _shared_gathers(self.pg, self.world_size, comm, specs)
        for g, gatherer in zip(specs, gathers, strict=True):
            groups.append(ShardGroup(g.params, g.names, dict(g.hparams), self.world_size, self.rank, self.pg,
                                     comm, in_cpu, gatherer))
            in_cpu = max(0, in_cpu - groups[-1].shard.numel())
        zp.fence(g.flat for g in groups)  # every shard written before any rank reads one
        return groups

    @property
    def norm_all_reduce(self) -> Callable[[torch.Tensor], None] | None:
        return sum_over_ranks(self.world_size, self.pg)

    def publish(self) -> None:
        """collective: re-gather every persistent parameter from the updated shards.

        Persistent parameters are many and small (biases, norms): each owner packs its pieces of
        all of a group's into one buffer and broadcasts it, one collective per owning rank instead
        of one per parameter and owner (measured: ~70 parameters of a GPT block stack, 3% of a
        step as separate broadcasts).
        """
        zp.fence(g.flat for g in self.groups)  # shared shards: every rank's update is done
        pending, read = [], []
        for g in self.groups:
            if isinstance(g.flat.gatherer, zp.SharedShards):  # copied out of the owners' shards
                for p in g.persistent:
                    g.flat.gatherer.gather_into(g.flat, p._dsl_offset, p._dsl_offset + p.ds_numel, p.data.view(-1))
                read += [g.flat] if g.persistent else []
                continue
            if g.flat.gatherer is not None:  # the shard was updated: hpZ's copy is stale
                g.flat.gatherer.invalidate()
            for owner, pieces in enumerate(_pieces_by_owner(g.flat, g.persistent)):
                if pieces:
                    pending.append((pieces, *_broadcast_pieces(g.flat, owner, pieces)))
        for pieces, buf, work in pending:
            wait_all((work,), "persistent parameters (broadcast)")
            dst = [p.data.view(-1)[lo - p._dsl_offset:hi - p._dsl_offset] for p, lo, hi in pieces]
            torch._foreach_copy_(dst, list(buf.split([hi - lo for _, lo, hi in pieces])))
        zp.fence(read)  # those reads done before any rank writes its shard again (a load right after)


def _shared_gathers(pg: Any, world: int, comm: CommSettings, specs: list[GroupSpec]) -> list[Any]:
    """Each group's gatherer where the group's ranks share this host (``shm.py``), else None:
    ``SharedShards`` (the shards themselves shared, gathers wait for nobody) where the shard lives
    in host memory where the parameters are used, else ``SharedMemoryGather`` (through slots of
    one rank's shard at most, reserved only then: shared shards need none)."""
    vectors = [_vector(g.params) for g in specs]
    in_place = not (comm.offload_param or any(device.type != "cpu" for _, _, device in vectors))
    slots = largest_piece(specs, world, whole=False)
    shm = SharedMemoryCollectives.build(pg, comm.shared_memory, 0 if in_place else slots)
    if shm is None:
        return [None] * len(specs)
    if not in_place:
        return [zp.SharedMemoryGather(shm) for _ in specs]
    shards = [SharedTensors.make(shm, shard_slot(numel, world), dtype) for numel, dtype, _ in vectors]
    # no room in /dev/shm for a group's shards: its gathers through slots (no room for them: gloo)
    through = SharedMemoryCollectives.build(pg, comm.shared_memory, slots) if None in shards else None
    return [zp.SharedShards(shm, s) if s is not None else None if through is None else zp.SharedMemoryGather(through)
            for s in shards]


def _vector(params: list[torch.nn.Parameter]) -> tuple[int, torch.dtype, torch.device]:
    """A param group's flat vector: its length, dtype and device (for ZeRO++'s gathers)."""
    return group_numel(params), group_dtype(params), params[0].device


def _pieces_by_owner(flat: zp.FlatShard, params: list[torch.nn.Parameter]) -> list[list[tuple]]:
    """For each rank, the (param, lo, hi) ranges of ``params`` in its part of ``flat``'s vector."""
    out: list[list[tuple]] = [[] for _ in range(flat.world)]
    for p in params:
        for r, lo, hi in zp.owner_pieces(flat, p._dsl_offset, p._dsl_offset + p.ds_numel):
            out[r].append((p, lo, hi))
    return out


def _broadcast_pieces(flat: zp.FlatShard, owner: int, pieces: list[tuple]) -> tuple[torch.Tensor, Any]:
    """Start broadcasting ``owner``'s ``pieces``, packed in order, to every rank: (buffer, work)."""
    device = flat.device or flat.shard.device
    buf = torch.empty(sum(hi - lo for _, lo, hi in pieces), dtype=flat.shard.dtype, device=device)
    if owner == flat.rank:
        k, at = shard_slot(flat.numel, flat.world), 0
        for _, lo, hi in pieces:
            flat.read(lo - owner * k, hi - owner * k, buf[at:at + hi - lo])
            at += hi - lo
    if flat.world == 1:
        return buf, None
    return buf, comm.broadcast(buf, src=zp.global_rank(flat, owner), group=flat.group, async_op=True)

