"""Tensors between pipeline stages: one message = a head, then the tensors.

The head (int64) says everything the receiver must allocate: whether the payload was a tuple,
then per tensor its dtype, whether it carries a gradient, its rank and shape. It precedes every
message (shapes may change from one micro batch to the next), so a receive never guesses and
never reuses a buffer of another dtype or shape: DeepSpeed's hangs with a float tensor that needs
no gradient and with buffers reused across dtypes at 3+ stages cannot happen here.

The head has a fixed size (``HEAD`` int64s; a longer header continues in a second part), so a
``Receiver`` posts the heads of all the messages a batch will bring at once (``irecv``): a message
sent while its receiver computes lands then. Tensors that fit in the head's rest travel in it
(small activations cost no round trip at all); larger ones follow in one part (a single tensor
as it is, several packed into one byte buffer), one round trip. On gloo a transfer starts only
once the receiver has posted its buffer, so a message of three blocking parts cost three round
trips on the schedule's critical path (scripts/bench/pipeline_bench.py).

Sends are non-blocking (``isend``: the sender goes on at once, a ``PendingSend`` keeps the tensors
alive until ``wait``); receives block. A rank whose batch failed sends a stop (``send_stop``: a
head whose length is -1, then the reason) in place of each message it still owed; the receiver's
``recv`` raises ``PipelineStageError`` with that reason instead of waiting. Within one direction
between two ranks messages arrive in the order sent, so a schedule only needs every receive to
have a matching send. Heads and tensors travel under two tags derived from the caller's
(``2 * tag`` and ``2 * tag + 1``), so posted heads never match a tensor part. Booleans travel as uint8
(gloo has no bool). Everything goes through ``dslaunch.comm`` (the comms logger counts it) and
every wait is marked as one on the peer (``heartbeat.waiting``): in a hang the monitor tells the
stage that never sent from the ones waiting for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import PipelineStageError, UsageError
from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import waiting

__all__ = ["Payload", "PendingSend", "Receiver", "send", "send_stop", "recv", "DTYPES", "HEAD"]

# The dtypes a message may carry, by wire code (the index).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool)
_CODE = {dt: code for code, dt in enumerate(DTYPES)}
HEAD = 512
"""int64s in a message's first part (4 KiB): the header's length, then (the start of) the header,
then the tensors' bytes when they fit in the rest."""
_ALIGN = 8  # bytes: each packed tensor starts at a multiple, so its bytes view as its dtype
_STOP = -1  # a head's length field: the sender stopped its batch; then the reason's length and bytes

Payload = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass
class PendingSend:
    """A message on its way: the works of its parts and the tensors they read."""

    works: list[Any] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    dst: int = -1

    def wait(self) -> None:
        with waiting(f"pipeline send to rank {self.dst}"):
            for w in self.works:
                w.wait()
        self.works.clear()
        self.tensors.clear()


def _header(tensors: Sequence[torch.Tensor], is_tuple: bool, what: str) -> torch.Tensor:
    fields = [int(is_tuple), len(tensors)]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"pipeline: {what} item {i} is {type(t).__name__}; only tensors (or a tuple of "
                             "tensors) pass between stages")
        if t.dtype not in _CODE:
            raise UsageError(f"pipeline: {what} item {i} has dtype {t.dtype}; stages exchange "
                             f"{', '.join(str(d) for d in DTYPES)}")
        fields += [_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return torch.tensor(fields, dtype=torch.int64)


def _wire(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    t = t.view(torch.uint8) if t.dtype == torch.bool else t
    return t.to("cpu") if _needs_host(t) else t


def _needs_host(t: torch.Tensor) -> bool:
    # gloo moves host memory only; with nccl the tensors stay where they are.
    return t.device.type != "cpu" and dist.get_backend() == "gloo"


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _packed_bytes(tensors: list[torch.Tensor]) -> int:
    """The size of the tensor part: one tensor's own, several aligned one after the other."""
    return tensors[0].nbytes if len(tensors) == 1 else sum(_padded(t.nbytes) for t in tensors)


def _room(header_length: int) -> int:
    """Bytes of the head left for tensors after a header of ``header_length`` fields (-1: none)."""
    return (HEAD - 1 - header_length) * 8 if header_length < HEAD else -1


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor part: one tensor as it is, several as one byte buffer; None: no bytes at all."""
    wires = [_wire(t) for t in tensors]
    if sum(w.numel() for w in wires) == 0:
        return None
    if len(wires) == 1:
        return wires[0]
    buf = torch.zeros(_packed_bytes(wires), dtype=torch.uint8, device=wires[0].device)
    pos = 0
    for w in wires:
        buf[pos:pos + w.nbytes] = w.reshape(-1).view(torch.uint8)
        pos += _padded(w.nbytes)
    return buf


def _split(buf: torch.Tensor, wires: list[torch.Tensor]) -> list[torch.Tensor]:
    """``_pack``'s inverse: views of ``buf`` (uint8) shaped as ``wires``."""
    pos, out = 0, []
    for w in wires:
        out.append(buf[pos:pos + w.nbytes].view(w.dtype).view(w.shape))
        pos += _padded(w.nbytes)
    return out


def send(payload: Payload, dst: int, group: Any = None, what: str = "message", tag: int = 0) -> PendingSend:
    """Start sending a tensor or a tuple of tensors to global rank ``dst``; returns at once.

    Messages with one ``tag`` arrive in the order sent; other tags are other queues.

    Raises:
        UsageError: an item that is not a tensor, or of a dtype stages cannot exchange.
    """
    is_tuple = isinstance(payload, tuple | list)
    tensors = list(payload) if is_tuple else [payload]
    fields = _header(tensors, is_tuple, what).tolist()
    head = torch.zeros(HEAD, dtype=torch.int64)
    first = fields[:HEAD - 1]
    head[0], head[1:1 + len(first)] = len(fields), torch.tensor(first, dtype=torch.int64)
    parts = [(head, 2 * tag)]
    if len(fields) > len(first):
        parts.append((torch.tensor(fields[len(first):], dtype=torch.int64), 2 * tag + 1))
    data = _pack(tensors)
    if data is not None and data.device.type == "cpu" and data.nbytes <= _room(len(fields)):
        start = (1 + len(fields)) * 8  # in the head: no part of its own
        head.view(torch.uint8)[start:start + data.nbytes] = data.reshape(-1).view(torch.uint8)
    elif data is not None:
        parts.append((data, 2 * tag + 1))
    pending = PendingSend(tensors=[t for t, _ in parts], dst=dst)
    for part, part_tag in parts:
        pending.works.append(comm.isend(part, dst, group=group, tag=part_tag))
    return pending


def send_stop(reason: str, dst: int, group: Any = None, tag: int = 0) -> PendingSend:
    """In place of the next message under ``tag``: this rank stopped its batch (``reason``: which
    stage, where, what it raised); the receiver's ``recv`` raises ``PipelineStageError(reason)``.
    One head, which a posted receive takes at once."""
    data = reason.encode()[:(HEAD - 2) * 8]
    head = torch.zeros(HEAD, dtype=torch.int64)
    head[0], head[1] = _STOP, len(data)
    if data:
        head.view(torch.uint8)[16:16 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return PendingSend([comm.isend(head, dst, group=group, tag=2 * tag)], [head], dst)


class Receiver:
    """The next ``count`` messages from global rank ``src`` under ``tag``: their heads are posted
    at once (see the module docstring); ``recv`` takes them in order. Post exactly the messages
    that will come: a head left posted would take a later message's."""

    def __init__(self, src: int, count: int, group: Any = None, tag: int = 0):
        self.src, self.group, self.tag = src, group, tag
        self._heads: deque[tuple[torch.Tensor, Any]] = deque()
        for _ in range(count):
            head = torch.empty(HEAD, dtype=torch.int64)
            self._heads.append((head, comm.irecv(head, src, group=group, tag=2 * tag)))

    def recv(self, device: torch.device) -> Payload:
        """The next message (blocks until it has arrived).

        Floating tensors the sender marked as carrying a gradient come back as leaves with
        ``requires_grad=True`` (their ``.grad`` is what goes back); the others never ask for one.

        Raises:
            PipelineStageError: the sender stopped its batch (``send_stop``) instead.
        """
        head, work = self._heads.popleft()
        with waiting(f"pipeline receive from rank {self.src}"):
            work.wait()
        length, *fields = head.tolist()
        if length == _STOP:
            reason = bytes(head.view(torch.uint8)[16:16 + fields[0]].tolist())
            raise PipelineStageError(reason.decode(errors="replace"))
        fields = fields[:length]
        if length > len(fields):  # a long header: its rest is the next part
            rest = torch.empty(length - len(fields), dtype=torch.int64)
            comm.recv(rest, self.src, group=self.group, tag=2 * self.tag + 1)
            fields += rest.tolist()
        is_tuple, specs = _specs(fields)
        wires = self._tensors(specs, head, length)
        out = []
        for (dtype, grad, _), wire in zip(specs, wires, strict=True):
            t = (wire.view(torch.bool) if dtype == torch.bool else wire).to(device)
            out.append(t.requires_grad_(grad and t.is_floating_point()))
        return tuple(out) if is_tuple else out[0]

    def _tensors(self, specs: list[tuple[torch.dtype, bool, list[int]]], head: torch.Tensor,
                 length: int) -> list[torch.Tensor]:
        wires = [torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype) for dtype, _, shape in specs]
        size = _packed_bytes(wires) if wires else 0
        if sum(w.numel() for w in wires) == 0:
            return wires
        if size <= _room(length):  # they came in the head
            start = (1 + length) * 8
            return _split(head.view(torch.uint8)[start:start + size], wires)
        if len(wires) == 1:
            comm.recv(wires[0], self.src, group=self.group, tag=2 * self.tag + 1)
            return wires
        buf = torch.empty(size, dtype=torch.uint8)
        comm.recv(buf, self.src, group=self.group, tag=2 * self.tag + 1)
        return _split(buf, wires)


def _specs(fields: list[int]) -> tuple[bool, list[tuple[torch.dtype, bool, list[int]]]]:
    """The header's fields -> (is a tuple, per tensor: dtype, gradient flag, shape)."""
    is_tuple, count, pos = bool(fields[0]), fields[1], 2
    specs = []
    for _ in range(count):
        dtype, grad, ndim = DTYPES[fields[pos]], bool(fields[pos + 1]), fields[pos + 2]
        specs.append((dtype, grad, fields[pos + 3:pos + 3 + ndim]))
        pos += 3 + ndim
    return is_tuple, specs


def recv(src: int, device: torch.device, group: Any = None, tag: int = 0) -> Payload:
    """Receive one message from global rank ``src`` (blocks until it has arrived); a schedule's
    receives go through a ``Receiver`` posted ahead instead."""
    return Receiver(src, 1, group, tag).recv(device)
