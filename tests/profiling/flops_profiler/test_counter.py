"""Counting at the aten operator level: a GPT's training step against the analytic count
(6N + 12·L·H·Q·T per token), attention written three ways, the real backward (with activation
checkpointing's recomputation), per-module rows that add up, convolutions, ignored modules and
torch.compile."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.profiling.flops_profiler import FlopsProfiler
from tests.profiling.flops_profiler.gpt import GPT, analytic_step_flops, matmul_params

pytestmark = pytest.mark.timeout(120)

B, T = 3, 16


def _step(model: torch.nn.Module, vocab: int = 64) -> FlopsProfiler:
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (B, T))
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(tokens, tokens).backward()
    prof.stop_profile()
    return prof


@pytest.mark.parametrize("impl", ["matmul", "einsum", "sdpa"])
def test_a_gpt_training_step_matches_the_analytic_count(impl: str) -> None:
    model = GPT(impl=impl, seq=T)
    prof = _step(model)
    want = analytic_step_flops(model, B, T)
    got = prof.get_total_flops()
    if impl == "sdpa":
        # SDPA's backward kernel recomputes Q·K^T (one more B·H·T·T·Q matmul per layer than the
        # 12·L·H·Q·T convention): counted, since it runs.
        assert got == want + len(model.blocks) * 2 * B * T * T * 32
        assert got == pytest.approx(want, rel=0.02)
    else:
        assert got == want
    p = prof.profile()
    assert p.fwd_flops == B * T * (2 * matmul_params(model) + 4 * len(model.blocks) * 32 * T)
    assert prof.get_total_macs() == got // 2
    assert prof.get_total_params() == sum(x.numel() for x in model.parameters())


def test_the_per_module_rows_add_up_to_the_total() -> None:
    model = GPT(impl="matmul", seq=T)
    p = _step(model).profile()
    rows = {r.name: r for r in p.rows}
    total = p.fwd_flops + p.bwd_flops
    assert sum(r.own_fwd_flops + r.own_bwd_flops for r in p.rows) + p.outside_fwd + p.outside_bwd == total
    assert rows["GPT"].fwd_flops + rows["GPT"].bwd_flops == total  # everything ran inside the model
    for i in range(len(model.blocks)):
        block, attn, mlp = (rows[f"blocks.{i}{s}"] for s in ("", ".attn", ".mlp"))
        assert block.fwd_flops == attn.fwd_flops + mlp.fwd_flops > 0
        assert block.bwd_flops == attn.bwd_flops + mlp.bwd_flops == 2 * block.fwd_flops
        # Q·K^T and P·V run in the attention module itself, not in its Linear children
        children = rows[f"blocks.{i}.attn.qkv"].fwd_flops + rows[f"blocks.{i}.attn.proj"].fwd_flops
        assert attn.own_fwd_flops == attn.fwd_flops - children == 4 * B * T * T * 32
    assert rows["head"].fwd_flops == 2 * B * T * 32 * 64 and rows["head"].bwd_flops == 4 * B * T * 32 * 64


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputation_is_counted_in_backward(reentrant: bool) -> None:
    plain = {r.name: r for r in _step(GPT(impl="matmul", seq=T)).profile().rows}
    model = GPT(impl="matmul", seq=T, checkpoint="reentrant" if reentrant else True)
    p = _step(model).profile()
    rows = {r.name: r for r in p.rows}
    recomputed = 0
    for i in range(len(model.blocks)):
        again = plain[f"blocks.{i}"].fwd_flops
        if not reentrant:
            # torch's non-reentrant checkpoint stops recomputing after the last tensor backward
            # needs: the block's last Linear does not run again. What ran is what counts.
            again -= plain[f"blocks.{i}.mlp.2"].fwd_flops
        assert rows[f"blocks.{i}"].bwd_flops == plain[f"blocks.{i}"].bwd_flops + again
        recomputed += again
    assert p.fwd_flops == plain["GPT"].fwd_flops
    assert p.bwd_flops == plain["GPT"].bwd_flops + recomputed
    assert rows["GPT"].fwd_flops + rows["GPT"].bwd_flops == p.fwd_flops + p.bwd_flops


def test_convolutions_count_and_ignored_modules_do_not() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 10))
    x = torch.randn(2, 3, 6, 6)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.stop_profile()
    conv = 2 * 2 * 8 * 3 * 9 * 6 * 6  # 2 flops x batch x out ch x in ch x kernel x output pixels
    assert prof.get_total_flops() == conv + 2 * 2 * 288 * 10
    prof.end_profile()
    prof.start_profile(ignore_list=[torch.nn.Conv2d])
    model(x.requires_grad_()).sum().backward()
    prof.stop_profile()
    # the Linear's forward and backward (input and weight gradients); not the convolution's backward
    assert prof.get_total_flops() == 3 * 2 * 2 * 288 * 10


# inductor compiles C++ (~66 s on 2 idle cores, >120 s beside two CPU hogs): the bound is for the
# compiler's time, not the counting's
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_model_counts_as_the_eager_one(backend: str) -> None:
    eager = _step(GPT(impl="sdpa", seq=T)).get_total_flops()
    model = GPT(impl="sdpa", seq=T)
    model.compile(backend=backend)
    tokens = torch.randint(0, 64, (B, T))
    try:
        model(tokens, tokens).backward()  # compile outside the profile
    except Exception as err:  # inductor needs a C compiler
        pytest.skip(f"torch.compile({backend}) unavailable here: {type(err).__name__}")
    assert _step(model).get_total_flops() == eager


class _Attend(torch.nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


class _CheckpointedAttention(torch.nn.Module):
    """Only the attention kernel checkpointed: its recomputation ends on the kernel's own outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.attend = _Attend()

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.attend, q, use_reentrant=False)


def test_a_recomputation_stopped_by_the_checkpoint_counts_what_ran() -> None:
    # torch's non-reentrant checkpoint ends a recomputation by raising while the last tensor
    # backward needs is saved: by the attention kernel after it ran (counted), by a matmul before.
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    model = torch.nn.Sequential(_CheckpointedAttention())
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(q).sum().backward()
    prof.stop_profile()
    fwd = 2 * (2 * 2 * 8 * 8) * (4 + 4)
    assert prof.profile().fwd_flops == fwd
    assert prof.profile().bwd_flops == fwd + 2 * (2 * 2 * 8 * 8) * (3 * 4 + 2 * 4)  # recomputed, then backward


def test_profiling_inside_torchs_profiler_is_a_one_line_error() -> None:
    prof = FlopsProfiler(GPT(seq=T))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(UsageError, match="torch's profiler is already running") as err:
            prof.start_profile()
    assert "\n" not in str(err.value)
    prof.start_profile()  # once torch's profiler is done
    prof.stop_profile()
