"""AutoEP on tiny Hugging Face MoE models built from configs (fp32): the converted model against the
unconverted one. Run it on N ranks (`dslaunch --num_gpus N autoep_parity.py FAMILY...`); rank 0 prints
`PARITY <json>` with the worst differences:

- forward: the loss of each rank's batch after conversion (experts spread over all N ranks) against
  the unconverted model's on the same batch, and every gradient: a dense one against the
  unconverted model's on that batch, an expert's against the sum over the ranks' batches (the
  all-to-all brings every rank's tokens to the expert's owner);
- training: STEPS steps through `deepspeed.initialize` at ZeRO-2 with `expert_parallel` against the
  unconverted model trained in one process on the mean of the ranks' losses (SGD with momentum,
  gradient clipping at 1.0 that acts).

FAMILY (one or more): mixtral, qwen3_moe (norm_topk_prob false), qwen3_moe_norm (true), deepseek_v3.
"""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

VOCAB, STEPS, LR = 64, 3, 0.5


def tiny(family: str) -> torch.nn.Module:
    """Two MoE layers of 4 experts, top-2; the routers' weights scaled up so the routing is uneven."""
    import transformers

    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 32, "num_experts_per_tok": 2}
    if family == "mixtral":  # with the router's auxiliary loss: the logits are recorded from the router module
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=32, num_local_experts=4, output_router_logits=True, router_aux_loss_coef=0.1, **common))
    elif family == "deepseek_v3":  # layer 0 dense; sigmoid scores, 2 groups of which 1 is chosen, shared experts
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=None, kv_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            moe_intermediate_size=32, intermediate_size=32, num_experts=4, head_dim=8,
            norm_topk_prob=family.endswith("norm"), **common))
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    return model.float().train()


def _preset(family: str) -> str:
    return family.removesuffix("_norm")


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1000 * step + rank))


def grads(model: torch.nn.Module) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def aux_loss(model: torch.nn.Module, x: torch.Tensor) -> float:
    out = model(input_ids=x, labels=x)
    return 0.0 if getattr(out, "aux_loss", None) is None else out.aux_loss.item()


def forward_parity(family: str, rank: int, world: int) -> dict:
    from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig
    from dslaunch.runtime.moe.autoep import convert_for_expert_parallel

    x = batch(rank, 0)
    ref = tiny(family)
    ref_loss = ref(input_ids=x, labels=x).loss
    ref_loss.backward()
    want = grads(ref)
    model = tiny(family)
    convert_for_expert_parallel(model, ExpertParallelConfig(enabled=True, autoep_size=world, preset_model=_preset(family)))
    for module in model.modules():
        if hasattr(module, "set_deepspeed_parallelism"):
            module.set_deepspeed_parallelism()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    got = grads(model)
    worst_expert = worst_dense = 0.0
    local = 4 // world
    for name, g in got.items():
        if name.endswith(("gate_up_proj", "down_proj")) and ".mlp.experts." in name:
            whole = want[name].clone()
            dist.all_reduce(whole)
            worst_expert = max(worst_expert, (g - whole[rank * local:(rank + 1) * local]).abs().max().item())
        else:
            source = name.replace(".gate.router.", ".gate.")
            worst_dense = max(worst_dense, (g - want[source]).abs().max().item())
    expert_names = [n for n in got if ".mlp.experts." in n]
    return {"loss": abs(loss.item() - ref_loss.item()), "aux_loss": [aux_loss(ref, x), aux_loss(model, x)],
            "dense_grad": worst_dense, "expert_grad": worst_expert,
            "expert_shapes": [list(got[n].shape) for n in expert_names[:2]], "grads": len(got), "ref_grads": len(want)}


def training_parity(family: str, rank: int, world: int) -> dict:
    ref = tiny(family)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    want, norms = [], []
    for step in range(STEPS):
        loss = sum(ref(input_ids=batch(r, step), labels=batch(r, step)).loss for r in range(world)) / world
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
              "zero_optimization": {"stage": 2},
              "expert_parallel": {"enabled": True, "autoep_size": world, "preset_model": _preset(family)}}
    engine, *_ = deepspeed.initialize(model=tiny(family), config=config)
    converted = [m for m in engine.module.modules() if type(m).__name__ == "AutoEPMoE"]
    got = []
    for step in range(STEPS):
        x = batch(rank, step)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        got.append(mean.item() / world)
    return {"train_losses": max(abs(a - b) for a, b in zip(want, got, strict=True)), "losses": got,
            "clipped": min(norms) > 1.0, "converted": len(converted),
            "marked": all(p.group_name == f"ep_size_{world}" for m in converted for p in m.experts.parameters())}


def main() -> None:
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {}
    for family in (arg for arg in sys.argv[1:] if not arg.startswith("--")):  # the launcher adds --local_rank
        results[family] = {**forward_parity(family, rank, world), **training_parity(family, rank, world)}
    if rank == 0:
        print("PARITY " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
