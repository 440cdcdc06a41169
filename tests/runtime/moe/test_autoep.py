"""AutoEP without transformers (the Hugging Face models: tests/compat/test_autoep.py): the
``expert_parallel`` block's checks, the grouped experts against the loop, the detection's refusals,
and a model of the custom form (a ``moe_layer_pattern``, a plain linear router returning logits)
converted at world 2 giving the unconverted model's loss and gradients, and trained three steps at
ZeRO-3 (built under zero.Init) to the losses of the unconverted model trained in one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config
from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig
from dslaunch.runtime.moe.autoep_presets import detect
from dslaunch.runtime.moe.grouped_experts import GroupedExperts
from tests.distributed import run_world

HIDDEN, FFN, EXPERTS, TOP_K = 8, 12, 4, 2


class FusedExperts(torch.nn.Module):
    """Hugging Face 5's expert layout and arithmetic (MixtralExperts), in plain torch."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.3)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            token, slot = torch.where(index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.mlp_experts = FusedExperts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, HIDDEN)
        top, index = self.router(x).softmax(dim=-1).topk(TOP_K, dim=-1)
        return self.mlp_experts(x, index, top / top.sum(dim=-1, keepdim=True)).reshape(h.shape)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(moe_top_k=TOP_K)
        self.moe = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.moe:
            x = x + block(x)
        return self.head(x).square().mean()


CUSTOM = {"enabled": True, "moe_layer_pattern": r"moe\.\d+", "router_pattern": "router",
          "expert_pattern": "mlp_experts", "top_k_attr": "moe_top_k"}


def _section(**given: object) -> ExpertParallelConfig:
    return load_config({"train_micro_batch_size_per_gpu": 1, "expert_parallel": given}, 2).expert_parallel


@pytest.mark.parametrize(("given", "key", "says"), [
    ({"autoep_sise": 2}, "expert_parallel.autoep_sise", "did you mean 'autoep_size'"),
    ({"score_apply": "pre"}, "expert_parallel.score_apply", "not implemented"),
    ({"expert_tensor_parallel_size": 2}, "expert_parallel.expert_tensor_parallel_size", "only 1"),
    ({"load_balance_coeff": 0.01}, "expert_parallel.load_balance_coeff", "float 0.01 is not supported"),
    ({"load_balance_coeff": "1e-3"}, "expert_parallel.load_balance_coeff", "expert_bias"),
    ({"load_balance_coeff": False}, "expert_parallel.load_balance_coeff", "set it to null or omit the key"),
    ({"preset_model": "llama"}, "expert_parallel.preset_model", "mixtral, qwen3_moe, deepseek_v3"),
])
def test_block_refuses_in_one_line_naming_the_key(given: dict, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        _section(enabled=True, **given)
    assert key in str(err.value) and says in str(err.value) and "\n" not in str(err.value)


def test_block_reads_deepspeeds_keys_and_folds_with_autotp() -> None:
    cfg = _section(enabled=True, autoep_size=2, preset_model="mixtral", use_grouped_mm=False, top_k="auto",
                   score_func="auto", combine_impl="legacy_bmm", load_balance_coeff=None)
    assert (cfg.size, cfg.preset_model, cfg.use_grouped_mm, cfg.top_k) == (2, "mixtral", False, "auto")
    folded = load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2},
                          "expert_parallel": {"enabled": True, "autoep_size": 2}}, 4)  # test_autoep_folded.py trains it
    assert (folded.tensor_parallel.size, folded.expert_parallel.size) == (2, 2)


def test_grouped_mm_equals_the_loop_forward_and_backward() -> None:
    torch.manual_seed(0)
    weights = {"gate_up_proj": torch.randn(2, 2 * FFN, HIDDEN, requires_grad=True),
               "down_proj": torch.randn(2, HIDDEN, FFN, requires_grad=True)}
    names = ("gate_up_proj", "down_proj", None)
    grouped = GroupedExperts(weights, names, torch.nn.SiLU(), True, "ep_size_2")
    loop = GroupedExperts(weights, names, torch.nn.SiLU(), False, "ep_size_2")
    assert grouped.grouped == hasattr(torch, "_grouped_mm") and not loop.grouped
    x = torch.randn(2, 2, 3, HIDDEN)  # [ep, local experts, capacity, hidden]
    a, b = grouped(x), loop(x)
    a.square().sum().backward()
    b.square().sum().backward()
    assert (a - b).abs().max() <= 1e-5
    for name in ("gate_up_proj", "down_proj"):
        assert (getattr(grouped, name).grad - getattr(loop, name).grad).abs().max() <= 1e-4
        assert getattr(grouped, name).allreduce is False and getattr(grouped, name).group_name == "ep_size_2"
    rows = torch.randn(5, HIDDEN)  # the exact dispatch's groups: any size, empty ones too
    a, b = grouped.rows(rows, [5, 0]), loop.rows(rows, [5, 0])
    assert (a - b).abs().max() <= 1e-5 and (a[:5] - grouped(rows[:5].reshape(1, 1, 5, HIDDEN).expand(1, 2, 5, HIDDEN))[0, 0]).abs().max() <= 1e-5
    odd = {"gate_up_proj": torch.randn(2, 6, 6), "down_proj": torch.randn(2, 6, 3)}  # rows of 24 and 12 bytes
    assert not GroupedExperts(odd, names, torch.nn.SiLU(), True, "ep_size_2").grouped
    # rows of 12 fp32 (48 bytes) fit, of 12 bf16 (24 bytes) not: asked again after the engine's cast
    mixed = GroupedExperts({"gate_up_proj": torch.randn(2, 24, 12), "down_proj": torch.randn(2, 12, 12)}, names,
                           torch.nn.SiLU(), True, "ep_size_2")
    assert mixed.grouped == hasattr(torch, "_grouped_mm") and not mixed.to(torch.bfloat16).grouped
    assert mixed(torch.randn(1, 2, 3, 12, dtype=torch.bfloat16)).shape == (1, 2, 3, 12)


def test_detection_refuses_what_it_cannot_convert() -> None:
    with pytest.raises(ConfigError, match=r"autoep_size.*does not divide the 4 experts of moe\.0; use one of \[1, 2, 4\]"):
        detect(Net(), ExpertParallelConfig(**{**CUSTOM, "autoep_size": 3}))
    with pytest.raises(ConfigError, match=r"top_k.*3, but the mixtral model's router uses 2"):
        detect(Net(), ExpertParallelConfig(**{**CUSTOM, "preset_model": "mixtral", "top_k": 3}))
    with pytest.raises(ConfigError, match="found no MoE block to convert in Linear .*mixtral: modules matching"):
        detect(torch.nn.Linear(2, 2), ExpertParallelConfig(enabled=True, preset_model="mixtral"))
    specs = detect(Net(), ExpertParallelConfig(**CUSTOM))
    assert [(s.name, s.num_experts, s.top_k) for s in specs] == [("moe.0", 4, 2), ("moe.1", 4, 2)]


def _converted(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dslaunch.runtime.moe.autoep import convert_for_expert_parallel

    dist.init_process_group("gloo")
    x = torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(rank))
    ref = Net()
    ref(x).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    model = Net()
    convert_for_expert_parallel(model, ExpertParallelConfig(**{**CUSTOM, "autoep_size": world}))
    for module in model.modules():
        if hasattr(module, "set_deepspeed_parallelism"):
            module.set_deepspeed_parallelism()
    assert type(model.moe[0]).__name__ == "AutoEPMoE" and model.moe[0].experts.gate_up_proj.shape[0] == EXPERTS // world
    loss = model(x)
    loss.backward()
    out = {"loss": abs(loss.item() - ref(x).item()), "dense": 0.0, "expert": 0.0}
    for name, p in model.named_parameters():
        if ".experts." in name:  # the converted block's experts are MOELayer's, named "experts"
            whole = want[name.replace(".experts.", ".mlp_experts.")].clone()
            dist.all_reduce(whole)  # every rank's tokens reach the expert's owner
            local = EXPERTS // world
            out["expert"] = max(out["expert"], (p.grad - whole[rank * local:(rank + 1) * local]).abs().max().item())
        else:
            out["dense"] = max(out["dense"], (p.grad - want[name.replace(".gate.router.", ".router.")]).abs().max().item())
    out["zero3"] = _zero3_steps(rank, world)
    return out


def _zero3_steps(rank: int, world: int) -> float:
    """Three steps through initialize at ZeRO-3, the model built under zero.Init (partitioned before
    AutoEP slices it), against the unconverted model trained in one process."""
    import torch.distributed as dist

    import dslaunch as deepspeed

    config = {"train_micro_batch_size_per_gpu": 6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}, "expert_parallel": {**CUSTOM, "autoep_size": world}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Net()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = 0.0
    for step in range(3):
        xs = [torch.randn(6, 3, HIDDEN, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        want = sum(ref(x) for x in xs) / world
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default clip
        opt.step()
        opt.zero_grad()
        loss = engine(xs[rank])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst = max(worst, abs(mean.item() / world - want.item()))
    return worst


def test_a_custom_model_converted_at_world_2_equals_the_unconverted_one_and_trains_at_zero3() -> None:
    for rank, got in enumerate(run_world(_converted, 2)):
        assert max(got.values()) <= 1e-5, f"rank {rank}: {got}"


def test_deepspeeds_autoep_universal_refuses_expert_tensor_slices_in_one_line() -> None:
    """``deepspeed.checkpoint.autoep_universal`` imports; its consolidation of expert tensor slices
    (``tp_degree`` > 1) is refused in one line (the rest: tests/runtime/checkpoint/test_deepspeed_autoep.py)."""
    from dslaunch.checkpoint.autoep_universal import consolidate_autoep_zero12_expert_states
    from dslaunch.errors import NotInDslaunchError

    with pytest.raises(NotInDslaunchError, match="tp_degree=2") as err:
        consolidate_autoep_zero12_expert_states("tmp", "out", {}, {}, 2, 2)
    assert "\n" not in str(err.value)
