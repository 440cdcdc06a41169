"""The vocab-parallel cross-entropy on 2 gloo ranks against ``F.cross_entropy`` of the whole logits:
an uneven vocabulary (7 = 4 + 3), ignored targets, and Hugging Face's ``num_items_in_batch``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.distributed import run_world

VOCAB, TOKENS = 7, 10


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, TOKENS // 2, VOCAB, generator=g) * 3
    labels = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    labels[0, 1] = labels[1, 3] = -100
    return logits, labels


def _split(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dslaunch.runtime.tensor_parallel.loss import causal_lm_loss

    dist.init_process_group("gloo")
    logits, labels = _data()
    start, stop = (0, 4) if rank == 0 else (4, VOCAB)
    local = logits[..., start:stop].clone().requires_grad_()
    loss_fn = causal_lm_loss(start, dist.group.WORLD)
    mean = loss_fn(logits=local, labels=labels, vocab_size=VOCAB)
    mean.backward()
    summed = loss_fn(logits=local.detach(), labels=labels, vocab_size=VOCAB, num_items_in_batch=torch.tensor(3))
    dist.destroy_process_group()
    return {"mean": mean.item(), "grad": local.grad.tolist(), "summed": summed.item()}


def test_equals_the_cross_entropy_of_the_whole_logits() -> None:
    logits, labels = _data()
    whole = logits.clone().requires_grad_()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    want = F.cross_entropy(whole.reshape(-1, VOCAB), shifted)
    want.backward()
    want_sum = F.cross_entropy(logits.reshape(-1, VOCAB), shifted, reduction="sum") / 3
    got = run_world(_split, 2)
    for rank in got:
        assert abs(rank["mean"] - want.item()) <= 1e-6, (rank["mean"], want.item())
        assert abs(rank["summed"] - want_sum.item()) <= 1e-5, (rank["summed"], want_sum.item())
    grad = torch.cat([torch.tensor(got[0]["grad"]), torch.tensor(got[1]["grad"])], dim=-1)
    assert (grad - whole.grad).abs().max().item() <= 1e-7
    assert grad[0, 0].abs().sum().item() == 0.0  # its next token is ignored: no gradient
