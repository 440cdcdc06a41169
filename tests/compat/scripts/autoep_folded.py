"""AutoEP folded with AutoTP on tiny Hugging Face MoE models built from configs (fp32), on 4 ranks:
tensor 2 x data 2, experts over 2 ranks, AutoTP's own planner (attention split by heads, the MoE
blocks' routers and experts left whole). Three clipped SGD steps at ZeRO-1 against the unconverted
model trained in one process on the mean of the two replicas' losses; rank 0 prints
`FOLDED <json>`: per family, the worst loss and global-norm differences, the reference's norm
(above the clip: it acts) and the shapes of layer 0's parameters on rank 0.

FAMILY (one or more): mixtral, qwen3_moe (per-head q/k norms).
"""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

VOCAB, STEPS, LR, CLIP = 64, 3, 0.5, 0.5


def tiny(family: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 32, "num_experts_per_tok": 2}
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(intermediate_size=32, num_local_experts=4,
                                                                          **common))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=32, moe_intermediate_size=16, num_experts=4, norm_topk_prob=True, head_dim=8,
        decoder_sparse_step=1, **common))


def batch(replica: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(100 * step + replica))


def run(family: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP, "steps_per_print": 1000,
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "tensor_parallel": {"autotp_size": 2},
              "expert_parallel": {"enabled": True, "autoep_size": 2, "use_grouped_mm": False}}
    engine, *_ = deepspeed.initialize(model=tiny(family), config=config)
    ref = tiny(family)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    out = {"loss": 0.0, "norm": 0.0, "ref_norm": 0.0,
           "shapes": {n: list(p.shape) for n, p in engine.module.named_parameters() if ".layers.0." in n}}
    replicas = world // 2
    for step in range(STEPS):
        want = sum(ref(input_ids=batch(r, step), labels=batch(r, step)).loss for r in range(replicas)) / replicas
        want.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item()
        opt.step()
        opt.zero_grad()
        ids = batch(rank // 2, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["loss"] = max(out["loss"], abs(mean.item() / world - want.item()))
        out["norm"] = max(out["norm"], abs(engine.get_global_grad_norm() - norm))
        out["ref_norm"] = max(out["ref_norm"], norm)
    return out


def main() -> None:
    deepspeed.init_distributed()
    results = {family: run(family) for family in sys.argv[1:] if not family.startswith("--")}
    if dist.get_rank() == 0:
        print("FOLDED " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
