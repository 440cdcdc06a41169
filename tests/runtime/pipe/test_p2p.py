"""Messages between stages: every dtype, shape and gradient flag arrives as sent, in order,
whatever the previous message was (no buffer reused across dtypes or shapes), whether the tensors
fit in the message's head or not, and with a header longer than the head."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world

pytestmark = pytest.mark.timeout(60)


def _payloads() -> list:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(2, 3, generator=g).requires_grad_(), torch.randn(4, generator=g),
         torch.arange(5, dtype=torch.int64)),
        torch.randn(3, 1, 2, generator=g).half(),
        (torch.tensor([True, False, True]), torch.randn(2, generator=g).bfloat16().requires_grad_(),
         torch.tensor(7, dtype=torch.int32), torch.empty(0, 4, dtype=torch.float64)),
        (),
        torch.randn(6, generator=g).requires_grad_(),
        torch.randn(40, 40, generator=g),  # over the head's room: a part of its own
        (torch.randn(30, 30, generator=g).half(), torch.arange(3, dtype=torch.int16), torch.randn(700, generator=g)),
        tuple(torch.full((1,), float(i)) for i in range(200)),  # a header longer than the head
    ]


def _describe(payload) -> list:
    items = payload if isinstance(payload, tuple) else (payload,)
    return [isinstance(payload, tuple)] + [(str(t.dtype), list(t.shape), t.requires_grad, t.detach().double().tolist())
                                           for t in items]


def _exchange(rank: int, world: int) -> list:
    import torch.distributed as dist

    from dslaunch.runtime.pipe import p2p

    dist.init_process_group("gloo")
    if rank == 0:
        pending = [p2p.send(p, 1) for p in _payloads()]  # all in flight before the receiver reads one
        for p in pending:
            p.wait()
        return []
    return [_describe(p2p.recv(0, torch.device("cpu"))) for _ in _payloads()]


def test_every_message_arrives_with_its_dtypes_shapes_and_gradient_flags() -> None:
    got = run_world(_exchange, 2)[1]
    assert got == [_describe(p) for p in _payloads()]


def _bad(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from dslaunch.errors import UsageError
    from dslaunch.runtime.pipe import p2p

    dist.init_process_group("gloo")
    out = []
    for payload in ((torch.ones(1), None), torch.ones(1, dtype=torch.complex64)):
        try:
            p2p.send(payload, 1 - rank, what="stage 0's output")
        except UsageError as err:
            out.append(str(err))
    return out


def test_what_cannot_cross_a_stage_is_one_line() -> None:
    msgs = run_world(_bad, 2)[0]
    assert msgs[0] == ("pipeline: stage 0's output item 1 is NoneType; only tensors (or a tuple of tensors) pass "
                       "between stages")
    assert msgs[1].startswith("pipeline: stage 0's output item 0 has dtype torch.complex64; stages exchange")
