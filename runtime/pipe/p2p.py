"""Tensors between pipeline stages: one message = a header, then the tensors.

The header (int64) says everything the receiver must allocate: whether the payload was a tuple,
then per tensor its dtype, whether it carries a gradient, its rank and shape. It precedes every
message (shapes may change from one micro batch to the next), so a receive never guesses and
never reuses a buffer of another dtype or shape: DeepSpeed's hangs with a float tensor that needs
no gradient and with buffers reused across dtypes at 3+ stages cannot happen here.

Sends are non-blocking (``isend``: the sender goes on at once, a ``PendingSend`` keeps the
tensors alive until ``wait``); receives block. Within one direction between two ranks messages
arrive in the order sent, so a schedule only needs every receive to have a matching send.
Booleans travel as uint8 (gloo has no bool). Everything goes through ``dslaunch.comm`` (the comms
logger counts it) and every wait is marked as one on the peer (``heartbeat.waiting``): in a hang the
monitor tells the stage that never sent from the ones waiting for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dslaunch import comm
from dslaunch.errors import UsageError
from dslaunch.runtime.heartbeat import waiting

__all__ = ["Payload", "PendingSend", "send", "recv", "DTYPES"]

# The dtypes a message may carry, by wire code (the index).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool)
_CODE = {dt: code for code, dt in enumerate(DTYPES)}

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
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def send(payload: Payload, dst: int, group: Any = None, what: str = "message", tag: int = 0) -> PendingSend:
    """Start sending a tensor or a tuple of tensors to global rank ``dst``; returns at once.

    Messages with one ``tag`` arrive in the order sent; other tags are other queues.

    Raises:
        UsageError: an item that is not a tensor, or of a dtype stages cannot exchange.
    """
    is_tuple = isinstance(payload, tuple | list)
    tensors = list(payload) if is_tuple else [payload]
    header = _header(tensors, is_tuple, what)
    parts = [torch.tensor([header.numel()], dtype=torch.int64), header,
             *(_wire(t).to("cpu") if _needs_host(t) else _wire(t) for t in tensors)]
    pending = PendingSend(tensors=parts, dst=dst)
    for part in parts:
        pending.works.append(comm.isend(part, dst, group=group, tag=tag))
    return pending


def _needs_host(t: torch.Tensor) -> bool:
    # gloo moves host memory only; with nccl the tensors stay where they are.
    return t.device.type != "cpu" and dist.get_backend() == "gloo"


def recv(src: int, device: torch.device, group: Any = None, tag: int = 0) -> Payload:
    """Receive one message from global rank ``src`` (blocks until it has arrived).

    Floating tensors the sender marked as carrying a gradient come back as leaves with
    ``requires_grad=True`` (their ``.grad`` is what goes back); the others never ask for one.
    """
    length = torch.empty(1, dtype=torch.int64)
    comm.recv(length, src, group=group, tag=tag)
    header = torch.empty(int(length.item()), dtype=torch.int64)
    comm.recv(header, src, group=group, tag=tag)
    fields = header.tolist()
    is_tuple, count, pos = bool(fields[0]), fields[1], 2
    out = []
    for _ in range(count):
        dtype, grad, ndim = DTYPES[fields[pos]], bool(fields[pos + 1]), fields[pos + 2]
        shape = fields[pos + 3:pos + 3 + ndim]
        pos += 3 + ndim
        wire = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype)
        comm.recv(wire, src, group=group, tag=tag)
        t = (wire.view(torch.bool) if dtype == torch.bool else wire).to(device)
        out.append(t.requires_grad_(grad and t.is_floating_point()))
    return tuple(out) if is_tuple else out[0]
