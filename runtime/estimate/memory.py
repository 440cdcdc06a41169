"""Bytes a training job holds per device and per host: ``estimate_memory(shape, setup)``.

The model is dslaunch's engine as built (``runtime/zero/``), not a rule of thumb:

- weights: the flat buffer in the model dtype, whole below stage 3, this rank's shard at stage 3
  (in host memory with ``offload_param: cpu``, on disk with ``nvme`` beyond ``max_in_cpu``);
- gradients: stages 0/1 keep the whole gradient in the model dtype (plus an fp32 copy of the rank's
  range for 16-bit models), or in fp32 with ``grad_accum_fp32`` (then reduced through pooled 16-bit
  copies, and with bf16's deferred update every 16-bit gradient alive at backward's end); stage 2
  keeps only the rank's fp32 shard, stage 3 only while backward runs (not at its peak);
- master: an fp32 copy of the rank's range for 16-bit models (an fp32 model's master *is* its
  weights), in host memory with ``offload_optimizer``;
- optimizer state: per master element (Adam 8 bytes), on the rank's range from stage 1, in host
  memory with ``offload_optimizer: cpu``, on disk with ``nvme``;
- communication buffers: stage 2/3 reduce buckets (staging in the model dtype, up to
  ``MAX_INFLIGHT_BUFFERS + 1`` with ``overlap_comm``, else 1) of the largest bucket;
- shared memory (``shared_memory_collectives``, CPU ranks whose data-parallel group is on one
  host): ``/dev/shm`` segments instead of private buffers (``runtime/zero/shm.py``): the slots of
  each transport (two sets of a slot per rank, the slot the largest piece one operation moves, at
  most 8 MiB), and the buffers the ranks read from each other: the whole gradient at stages 0/1,
  the flat weights at 1/2, the weight shards at 3 (not with ``offload_param``); those leave the
  rank's private memory (``device``), and so do stage 3's gathered parameters inside one owner's
  shard (views of it). Counted per host (``shm``): what ``--shm-size`` must hold;
- stage 3's whole parameters while modules run: the persistent small ones always, and up to
  ``stage3_max_live_parameters`` elements (at least the largest layer) during forward/backward;
  none where one rank holds the whole shard where the modules run (its parameters are views of it);
- activations (when the transformer's dimensions are known): per layer, Korthikanti et al.'s
  count generalised to any dtype and FFN width (plus what a fused attention kernel keeps: its
  output beside the projection's input, and the softmax statistics), or the layer inputs plus one
  layer recomputed with activation checkpointing; then the logits and their fp32 loss, or
  backward's working set (an FFN activation's gradient, the largest parameter's fresh gradient),
  whichever is larger; pipeline stages hold their layers' activations for up to ``pipeline``
  micro batches in flight (1F1B's first stage). Layers without attention
  (``ModelShape.attention``) count the MLP half only. Checked against the peak of the tensors a
  real forward + backward creates (``estimate_bench.py``).

Data parallelism is ``world / (pipeline * tensor * sequence)``; ZeRO partitions over data x
sequence; expert parameters (``ModelShape.expert_params``) are held ``1/expert_parallel`` a rank
and partitioned over the expert-data group (data x sequence / expert_parallel), so from stage 1 a
rank's share of the master and optimizer state is the dense one's, ``1/(data x sequence)``; and a sequence rank holds ``1/sequence`` of each sample's activations (Ulysses); a pipeline stage holds ``1/pipeline`` of the
parameters, a tensor slice ``1/tensor`` (AutoTP training; parameters and activations divided, as Megatron
with sequence parallelism does: AutoTP keeps norms and the activations between blocks whole on
every tensor rank, so for AutoTP this is a lower bound).

Pure arithmetic and torch-free: the autotuner calls it for every candidate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from dslaunch.errors import UsageError
from dslaunch.runtime.estimate.setup import MODEL_BYTES, OPTIMIZER_STATE_BYTES, TrainingSetup
from dslaunch.runtime.estimate.shape import ModelShape

__all__ = ["Parts", "MemoryEstimate", "estimate_memory", "MAX_INFLIGHT_BUFFERS", "SLOT_BYTES"]

MAX_INFLIGHT_BUFFERS = 2  # runtime/zero/reducer.py's; a test keeps the two equal
SLOT_BYTES = 8 << 20  # runtime/zero/shm.py's: the largest shared-memory slot; a test keeps the two equal
PAGE = 4096  # a tmpfs segment holds whole pages


@dataclass(frozen=True)
class Parts:
    """Bytes by purpose, in one place (a device, or one host's memory, or one host's disk)."""

    weights: int = 0
    gradients: int = 0
    master: int = 0
    optimizer_state: int = 0
    comm_buffers: int = 0
    gathered: int = 0  # stage 3: whole parameters while modules run (persistent ones included)
    buffers: int = 0  # the module's registered buffers
    activations: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def model_states(self) -> int:
        """Everything but activations."""
        return self.total - self.activations

    def __add__(self, other: Parts) -> Parts:
        return Parts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: Parts) -> Parts:
        return Parts(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def scaled(self, k: int) -> Parts:
        return Parts(**{f.name: getattr(self, f.name) * k for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate of one setup.

    Attributes:
        setup: what was estimated.
        device: one device's peak bytes while training, activations included (0 when unknown).
        host: one host's bytes (every local rank's host-resident state; pinned staging included).
        nvme: one host's bytes on disk (swap files of every local rank).
        activations_known: the model's dimensions and ``seq_len`` were known.
        host_init: one host's peak while the model is built, before training (ranks that
            materialise the whole model in host memory, ``zero_init`` off or below stage 3).
        shm: one host's bytes in the shared-memory segment directory (``/dev/shm``, or
            ``DSLAUNCH_SHM_DIR``): every local data-parallel group's segments (0 unless
            ``setup.shared_memory`` applies: CPU ranks, one node, several data-parallel ranks).
            Host memory too, but apart from ``device`` and ``host``.
    """

    setup: TrainingSetup
    device: Parts
    host: Parts
    nvme: Parts
    activations_known: bool
    host_init: int
    shm: Parts = Parts()

    @property
    def device_bytes(self) -> int:
        return self.device.total

    @property
    def host_bytes(self) -> int:
        """One host's peak: steady-state training or model building, whichever is larger."""
        return max(self.host.total, self.host_init)

    @property
    def rank_bytes(self) -> int:
        """One rank's tensors wherever they are (device + its share of host and shared memory): on
        a CPU-only host, what a rank's process holds."""
        return self.device.total + (self.host.total + self.shm.total) // self.setup.gpus_per_node

    def fits(self, device_memory: int, host_memory: int | None = None) -> bool:
        """Whether the device (and, if given, the host) peak fits."""
        return self.device_bytes <= device_memory and (host_memory is None or self.host_bytes <= host_memory)


def estimate_memory(shape: ModelShape, setup: TrainingSetup | Mapping[str, Any], **overrides: Any) -> MemoryEstimate:
    """Per-device and per-host bytes of training ``shape`` with ``setup``.

    Args:
        shape: the model.
        setup: a ``TrainingSetup``, or a ds_config dict (read by ``TrainingSetup.from_ds_config``).
        overrides: ``TrainingSetup`` fields that win over ``setup`` (e.g. ``gpus_per_node=8``).

    Returns:
        A ``MemoryEstimate``; exact for the model states of dslaunch's engine up to allocator
        rounding (the tests hold it within 10% of the tensors an engine holds), activations
        are a transformer formula (0 and ``activations_known=False`` without dimensions).

    Raises:
        UsageError: an invalid setup (also: ``expert_parallel`` not dividing the model's experts).
    """
    if not isinstance(setup, TrainingSetup):
        setup = TrainingSetup.from_ds_config(setup, **overrides)
    elif overrides:
        setup = setup.with_(**overrides)
    s = setup
    if shape.num_experts and shape.num_experts % s.expert_parallel:
        raise UsageError(f"expert_parallel: got {s.expert_parallel}; valid: a divisor of the model's "
                         f"{shape.num_experts} experts a layer")
    r = _Rank.of(shape, s)
    placed = _weights(s, r) + _gradients(s, r) + _master_and_state(s, r) + _buffers(shape, s, r)
    acts = _activations(shape, s)
    segments, moved = _shared_memory(s, r) if _shared(s) else (Parts(), Parts())
    device = placed.device - moved + Parts(activations=acts or 0)
    # Each local rank builds the model in fp32 host memory first: whole, or under zero.Init one
    # module at a time; a model with experts builds only this rank's.
    held = shape.params - shape.expert_params + math.ceil(shape.expert_params / s.expert_parallel)
    built = shape.largest_layer if s.stage == 3 and s.zero_init else held
    k = s.gpus_per_node
    return MemoryEstimate(setup=s, device=device, host=placed.host.scaled(k), nvme=placed.disk.scaled(k),
                          activations_known=acts is not None, host_init=built * 4 * k,
                          shm=segments.scaled(k // (s.data_parallel * s.sequence) if segments.total else 0))


@dataclass(frozen=True)
class _Rank:
    """One rank's counts: its model part (``params``), the range it owns of the master/optimizer
    state (``shard``), its stage-3 weight shard (``weights``), the model dtype's bytes ``m``, and
    ``dense``: its part of the dense (non-expert) parameters."""

    params: int
    shard: int
    weights: int
    m: int
    dense: int

    @classmethod
    def of(cls, shape: ModelShape, s: TrainingSetup) -> _Rank:
        model_part = s.pipeline * s.tensor
        dense = math.ceil((shape.params - shape.expert_params) / model_part)
        experts = math.ceil(shape.expert_params / (s.expert_parallel * model_part))  # this rank's experts
        zero = s.data_parallel * s.sequence  # ZeRO partitions over data x sequence; experts over their part of it
        part = math.ceil(dense / zero) + math.ceil(experts * s.expert_parallel / zero)
        params = dense + experts
        return cls(params, part if s.stage >= 1 else params, part if s.stage == 3 else params,
                   MODEL_BYTES[s.precision], dense)

    @property
    def sixteen(self) -> bool:
        return self.m != 4


@dataclass(frozen=True)
class _Placed:
    """Bytes on the device, in this rank's host memory and in its swap files."""

    device: Parts = Parts()
    host: Parts = Parts()
    disk: Parts = Parts()

    def __add__(self, other: _Placed) -> _Placed:
        return _Placed(self.device + other.device, self.host + other.host, self.disk + other.disk)


def _weights_home(s: TrainingSetup) -> str:
    if s.stage == 3 and s.offload_param != "none":
        return "host" if s.offload_param == "cpu" else "nvme"
    return "device"


def _weights(s: TrainingSetup, r: _Rank) -> _Placed:
    """The flat weights: whole below stage 3, the shard at stage 3 (where offload_param puts it;
    with NVMe, all but ``max_in_cpu`` on disk, 16-bit or GPU transfers through a buffer pool)."""
    home = _weights_home(s)
    if home == "device":
        return _Placed(device=Parts(weights=r.weights * r.m))
    if home == "host":
        return _Placed(host=Parts(weights=r.weights * r.m))
    in_cpu = min(s.max_in_cpu, r.weights)
    on_disk = r.weights - in_cpu
    pool = 0
    if on_disk and (r.sixteen or s.accelerator == "cuda"):  # transfers that are no plain file read
        buffer = min(s.param_buffer_size, on_disk)
        pool = min(s.param_buffer_count, math.ceil(on_disk / buffer)) * buffer * r.m
    return _Placed(host=Parts(weights=in_cpu * r.m, comm_buffers=pool), disk=Parts(weights=on_disk * r.m))


def _gradients(s: TrainingSetup, r: _Rank) -> _Placed:
    """Whole (model dtype) at stages 0/1, plus an fp32 copy of the rank's range for 16-bit models,
    made next to the master (so in host memory when that is offloaded); the fp32 shard at 2. Stage
    3 frees its shard after each step (``ScopedGradients``) and makes it in backward while the
    gathered parameters are released: the peak is forward's (measured), so it adds nothing."""
    if s.stage == 3:
        return _Placed()
    if s.stage == 2:
        return _Placed(device=Parts(gradients=r.shard * 4))
    if _fp32_sums(s, r):  # the buffer is fp32 and the step reads it: no copy
        deferred = r.params * r.m if s.precision == "bf16" and not s.immediate_grad_update else 0
        return _Placed(device=Parts(gradients=r.params * 4 + deferred))
    copy = Parts(gradients=r.shard * 4 if r.sixteen else 0)
    whole = _Placed(device=Parts(gradients=r.params * r.m))
    return whole + (_Placed(host=copy) if _master_home(s) == "host" else _Placed(device=copy))


def _fp32_sums(s: TrainingSetup, r: _Rank) -> bool:
    """Stage 0/1's whole gradient is fp32 for a 16-bit model (``data_types.grad_accum_dtype``)."""
    return s.grad_accum_fp32 and r.sixteen and s.stage <= 1


def _master_home(s: TrainingSetup) -> str:
    return "host" if s.offload_optimizer != "none" or _weights_home(s) == "host" else "device"


def _master_and_state(s: TrainingSetup, r: _Rank) -> _Placed:
    """The fp32 master and the optimizer state: in host memory with the offloaded optimizer or the
    stage-3 shard on the host. The master is a copy for 16-bit models, or where it lives apart
    from the weights (on a CPU-only host an "offloaded" fp32 master still is the weights)."""
    weights, home = _weights_home(s), _master_home(s)
    same = weights == home or (s.accelerator == "cpu" and weights != "nvme")
    master = r.shard * 4 if r.sixteen or not same else 0
    state = r.shard * OPTIMIZER_STATE_BYTES[s.optimizer]
    if home == "device":
        return _Placed(device=Parts(master=master, optimizer_state=state))
    staging = 0
    if s.accelerator == "cuda" and s.offload_optimizer != "none":
        # pinned staging, two buckets ahead: gradients in, 16-bit parameters out
        bucket = min(s.sub_group_size, r.shard)
        staging = 2 * bucket * 4 + (2 * bucket * r.m if r.sixteen else 0)
    if s.offload_optimizer == "nvme":
        return _Placed(host=Parts(master=master, comm_buffers=staging + _nvme_ring(s, r.shard)),
                       disk=Parts(optimizer_state=state))
    return _Placed(host=Parts(master=master, optimizer_state=state, comm_buffers=staging))


def _buffers(shape: ModelShape, s: TrainingSetup, r: _Rank) -> _Placed:
    """Reduce buckets (stages 2/3), stage 3's whole parameters, the module's registered buffers."""
    parts = Parts(buffers=shape.buffer_bytes // (s.pipeline * s.tensor))
    if s.stage >= 2 or _fp32_sums(s, r):
        # A bucket holds whole parameters: a larger one gets a bucket of its own. Stage 0/1's fp32
        # sums go out through 16-bit copies, up to MAX_INFLIGHT_BUFFERS + 1 held at once.
        largest_param = max(shape.param_sizes, default=shape.largest_layer) // s.tensor
        bucket = max(min(s.reduce_bucket_size, r.params), largest_param)
        count = min(MAX_INFLIGHT_BUFFERS + 1 if s.overlap_comm or s.stage <= 1 else 1, math.ceil(r.params / bucket))
        parts += Parts(comm_buffers=bucket * r.m * count)
    if s.stage == 3 and not _resident(s):  # the persistent small ones, and up to max_live_parameters (at least a layer)
        persistent = shape.small_params(s.param_persistence_threshold) // (s.pipeline * s.tensor)
        live = min(r.params - persistent, max(s.max_live_parameters, shape.largest_layer // s.tensor))
        if _shared(s) and _weights_home(s) == "device":
            # shards in shared memory: a parameter inside one owner's shard is a view of it; only
            # those across a shard's edge (one per edge at most) are copies
            largest_param = max(shape.param_sizes, default=shape.largest_layer) // s.tensor
            live = min(live, (s.data_parallel * s.sequence - 1) * largest_param)
        parts += Parts(gathered=(persistent + live) * r.m)
    return _Placed(device=parts)


def _resident(s: TrainingSetup) -> bool:
    """Stage 3 whose shard is the whole model where the modules run (one rank partitions it, no
    offload to another device): the parameters are views of the shard, none is gathered."""
    home = _weights_home(s)
    return s.data_parallel * s.sequence == 1 and (home == "device" or (home == "host" and s.accelerator == "cpu"))


def _shared(s: TrainingSetup) -> bool:
    """Whether the engine's same-host shared-memory collectives apply: wanted, CPU ranks, a
    data-parallel (x sequence) group of several ranks, every rank on one host."""
    return s.shared_memory and s.accelerator == "cpu" and s.nodes == 1 and s.data_parallel * s.sequence > 1


def _shared_memory(s: TrainingSetup, r: _Rank) -> tuple[Parts, Parts]:
    """(one data-parallel group's ``/dev/shm`` segments, what they take out of each rank's private
    memory), for the dense parameters as one param group (the engine's largest group bounds its
    slots; experts' groups keep their buffers private here)."""
    w, m = s.data_parallel * s.sequence, r.m
    k = math.ceil(r.dense / w)  # one rank's shard; k * w: the group padded for the ranks
    # the gradient exchange: a bucket holds at most the whole group, summed in fp32 at most
    segments, moved = Parts(comm_buffers=_slots(w, k * w * 4)), Parts()
    if s.stage <= 1:  # the whole gradient, summed in place (stage 0's is not padded)
        g = 4 if _fp32_sums(s, r) else m
        segments += Parts(gradients=_pages(w * (r.dense if s.stage == 0 else k * w) * g))
        moved += Parts(gradients=r.dense * g)
    if s.stage in (1, 2):  # the flat weights, published in place; slots of a shard where they had no room
        segments += Parts(weights=_pages(w * k * w * m), comm_buffers=_slots(w, k * m))
        moved += Parts(weights=r.dense * m)
    if s.stage == 3 and _weights_home(s) == "device":  # the shards, read in place: slots for the waits only
        segments += Parts(weights=_pages(w * k * m), comm_buffers=_slots(w, 0))
        moved += Parts(weights=k * m)
    elif s.stage == 3:  # offloaded shards: gathers through slots of a shard
        segments += Parts(comm_buffers=_slots(w, k * m))
    return segments, moved


def _slots(world: int, piece: int) -> int:
    """A transport's slot segment: two sets of ``world`` slots, each ``piece`` bytes rounded up to
    64 and at most ``SLOT_BYTES``."""
    return _pages(2 * world * max(64, min(SLOT_BYTES, -(-piece // 64) * 64)))


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _nvme_ring(s: TrainingSetup, shard: int) -> int:
    """Bytes of ``offload_optimizer: nvme``'s ring in host memory: slots of one bucket of every
    state tensor, ``buffer_count // tensors`` of them, never more than the buckets of a pass."""
    tensors = max(1, OPTIMIZER_STATE_BYTES[s.optimizer] // 4)
    bucket = max(1, min(s.sub_group_size, s.nvme_buffer_size, shard))
    slots = max(1, min(s.nvme_buffer_count // tensors, math.ceil(shard / bucket)))
    return slots * tensors * bucket * 4


def _activations(shape: ModelShape, s: TrainingSetup) -> int | None:
    """Bytes of activations saved for backward on the busiest device; None when unknown."""
    if not shape.transformer or s.seq_len is None:
        return None
    m = MODEL_BYTES[s.precision]
    b, t, h = s.micro_batch, s.seq_len, shape.hidden
    f = shape.ffn or 4 * h
    a = shape.heads or 1
    # Ulysses: a rank holds 1/sequence of the tokens; around attention the whole sequence of
    # 1/sequence of the heads, the same a * t * tokens scores as written below
    tokens = b * math.ceil(t / s.sequence)
    # Korthikanti et al.'s 34 sbh + 5 a s^2 b at m = 2, f = 4h, in two halves. MLP: the norm's
    # input and output, a dropout mask, 2m per FFN element (the up projection's output, the
    # activation's output).
    per_layer = tokens * h * (2 * m + 1) + 2 * m * tokens * f
    if shape.attention:
        # the norm's input and output, Q, K, V, the projection's input, a dropout mask
        per_layer += tokens * h * (6 * m + 1)
        if s.flash_attention:  # the kernel keeps its output (the projection's input is a copy)
            per_layer += tokens * h * m + 4 * a * tokens  # and the fp32 log-sum-exp per head
        else:  # the scores: softmax output, its dropout's output and mask
            per_layer += (2 * m + 1) * a * t * tokens
    per_layer = math.ceil(per_layer / s.tensor)
    layers = math.ceil(shape.layers / s.pipeline)
    if s.activation_checkpointing:  # the layers' inputs, and one layer recomputed in backward
        stored = layers * tokens * h * m + per_layer
    else:
        stored = layers * per_layer
    in_flight = s.pipeline  # 1F1B: the first stage holds `pipeline` micro batches' activations
    logits = tokens * (shape.vocab or 0) * (m + 4) // s.tensor  # logits and their fp32 loss input
    # The peak is at the forward's end (the logits alive) or in backward: the gradient of an FFN
    # activation and the largest parameter's fresh gradient before it joins the gradient buffer.
    largest_param = max(shape.param_sizes, default=shape.largest_layer) // (s.tensor * s.pipeline)
    backward = (f * tokens // s.tensor + largest_param) * m
    return stored * in_flight + max(logits, backward)
