"""``deepspeed.sequence.cross_entropy``: DeepSpeed's vocabulary- and sequence-split cross-entropy on
dslaunch's vocab-parallel loss, against torch's cross-entropy of the whole logits in one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_world

VOCAB, SEQ, IGNORE = 10, 8, -100


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, SEQ, VOCAB, generator=g, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    target[0, 1] = target[1, 6] = IGNORE
    return logits, target


@pytest.mark.timeout(30)
def test_without_groups_it_is_torchs_cross_entropy() -> None:
    from dslaunch.errors import NotInDslaunchError
    from dslaunch.runtime.sequence_parallel.cross_entropy import vocab_parallel_cross_entropy as vpce

    logits, target = _data()
    flat = (logits.flatten(0, 1), target.flatten())
    for reduction in ("none", "sum", "mean"):
        want = F.cross_entropy(*flat, ignore_index=IGNORE, reduction=reduction).float()
        torch.testing.assert_close(vpce(logits, target, reduction=reduction).flatten(), want.flatten())
    bad = target.clone()
    bad[0, 0] = VOCAB
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\)"):
        vpce(logits, bad)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        vpce(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="must be given together"):
        vpce(logits, target, vocab_start_index=0)
    with pytest.raises(NotInDslaunchError, match="backend='liger' is not in dslaunch"):
        vpce(logits, target, backend="liger")


def _mesh(rank: int) -> tuple[object, object, int, int]:
    """TP 2 x SP 2 on 4 ranks: tensor groups {0,1},{2,3}; sequence groups {0,2},{1,3}."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return tps[rank // 2], sps[rank % 2], rank % 2, rank // 2


def _on_mesh(rank: int, world: int) -> dict[str, object]:
    from dslaunch.runtime.sequence_parallel import cross_entropy as ce

    tp, sp, tp_rank, sp_rank = _mesh(rank)
    logits, target = _data()
    half_v, half_s = VOCAB // 2, SEQ // 2
    cols, rows = slice(tp_rank * half_v, (tp_rank + 1) * half_v), slice(sp_rank * half_s, (sp_rank + 1) * half_s)
    out = {}
    local = logits[:, rows, cols].clone().requires_grad_()
    mean = ce.vocab_parallel_cross_entropy(local, target[:, rows], tp_group=tp, sp_group=sp)
    mean.backward()
    out["mean"], out["mean_grad"] = mean.detach(), local.grad
    # per-token losses of the whole sequence (gathered on dim 0: transpose so the sequence leads)
    local = logits[:, rows, cols].transpose(0, 1).contiguous().requires_grad_()
    tokens = ce.vocab_parallel_cross_entropy(local, target[:, rows].t().contiguous(), tp_group=tp, sp_group=sp,
                                             reduction="none", gather_sequence_loss=True)
    tokens.sum().backward()
    out["tokens"], out["tokens_grad"] = tokens.detach().t(), local.grad.transpose(0, 1)
    legacy = ce.vocab_sequence_parallel_cross_entropy(local.detach(), target[:, rows].t().contiguous(), sp, tp_group=tp)
    out["legacy"] = legacy.t()
    try:  # uneven shards without bounds: every rank raises
        ce.vocab_parallel_cross_entropy(logits[:, rows, : 4 + tp_rank], target[:, rows].clamp(max=8), tp_group=tp)
    except ValueError as exc:
        out["uneven"] = str(exc)
    uneven = logits[:, rows, :4] if tp_rank == 0 else logits[:, rows, 4:]
    out["explicit"] = ce.vocab_parallel_cross_entropy(uneven, target[:, rows], tp_group=tp,
                                                      vocab_start_index=0 if tp_rank == 0 else 4,
                                                      vocab_end_index=4 if tp_rank == 0 else VOCAB)
    return out


@pytest.mark.timeout(90)
def test_on_a_tensor_by_sequence_mesh_it_is_the_whole_sequences_loss() -> None:
    logits, target = _data()
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=IGNORE)
    want.backward()
    per_token = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE,
                                reduction="none").view(target.shape)
    summed = logits.clone().requires_grad_()
    F.cross_entropy(summed.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum").backward()
    token_grad = summed.grad
    for rank, got in enumerate(run_world(_on_mesh, 4)):
        tp_rank, sp_rank = rank % 2, rank // 2
        cols, rows = slice(tp_rank * 5, tp_rank * 5 + 5), slice(sp_rank * 4, sp_rank * 4 + 4)
        torch.testing.assert_close(got["mean"].double(), want.detach(), rtol=1e-6, atol=1e-6)
        # both sequence ranks' loss reads every rank's tokens: the sum's backward all-reduces, so each
        # rank holds 2x its slice (the engine's average over data x sequence halves it: test_gradients.py)
        torch.testing.assert_close(got["mean_grad"], 2 * full.grad[:, rows, cols], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["tokens"].double(), per_token, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["legacy"].double(), per_token, rtol=1e-6, atol=1e-6)
        # the gathered losses summed on both sequence ranks: each token's gradient summed over them
        torch.testing.assert_close(got["tokens_grad"], 2 * token_grad[:, rows, cols], rtol=1e-6, atol=1e-7)
        assert "uneven vocabulary shards need explicit" in got["uneven"]
        torch.testing.assert_close(got["explicit"].double(), F.cross_entropy(
            logits[:, rows].flatten(0, 1), target[:, rows].flatten(), ignore_index=IGNORE), rtol=1e-6, atol=1e-6)


class _Head:
    """What ``configure_vocab_parallel_loss`` reads of a vocabulary-split LM head."""

    def __init__(self, group: object, start: int, end: int):
        self.mp_group, self.vocab_start_index, self.vocab_end_index = group, start, end


class _Model(torch.nn.Module):
    def loss_function(self, *args: object, **kwargs: object) -> None:  # Hugging Face's hook, replaced
        raise AssertionError("the stock loss ran")


def _causal(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    from dslaunch.runtime.sequence_parallel import cross_entropy as ce

    dist.init_process_group("gloo")
    logits, target = _data()
    model = ce.configure_vocab_parallel_loss(_Model(), _Head(dist.group.WORLD, rank * 5, rank * 5 + 5))
    local = logits[..., rank * 5:rank * 5 + 5].clone().requires_grad_()
    loss = model.loss_function(local, labels=target, vocab_size=VOCAB)
    loss.backward()
    summed = model.loss_function(local.detach(), labels=target, num_items_in_batch=3)
    fn = model.loss_function
    try:
        fn(local.detach()[..., :4], labels=target)
    except RuntimeError as exc:
        changed = str(exc)
    plain = torch.nn.Module()
    try:
        ce.configure_vocab_parallel_loss(plain, _Head(dist.group.WORLD, 0, 5))
    except ValueError as exc:
        refused = str(exc)
    return {"loss": loss.detach(), "grad": local.grad, "summed": summed, "changed": changed, "refused": refused,
            "kept": model._deepspeed_original_loss_function.__func__ is _Model.loss_function}


@pytest.mark.timeout(60)
def test_the_causal_lm_loss_function_is_hugging_faces_on_a_split_head() -> None:
    logits, target = _data()
    full = logits.clone().requires_grad_()
    shifted = (full[:, :-1].flatten(0, 1), target[:, 1:].flatten())
    want = F.cross_entropy(*shifted, ignore_index=IGNORE)
    want.backward()
    total = F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), ignore_index=IGNORE,
                            reduction="sum")
    for rank, got in enumerate(run_world(_causal, 2)):
        torch.testing.assert_close(got["loss"].double(), want.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["grad"], full.grad[..., rank * 5:rank * 5 + 5], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["summed"].double(), total / 3, rtol=1e-6, atol=1e-6)
        assert "the vocabulary shard changed after its first call" in got["changed"]
        assert "has no loss_function to replace" in got["refused"] and got["kept"]
