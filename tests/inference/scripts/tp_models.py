"""Tiny models of each family AutoTP supports, built from transformers configs (no download), and
the job the tests launch: every family's logits and greedy tokens at tp=<world size> against the
unsharded model, and each rank's parameter bytes. Rank 0 prints ``RESULTS {json}``.

Usage: dslaunch --num_gpus N tp_models.py [families...]   (tp = N; also runs alone as tp=1)
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import transformers as T

import dslaunch

# Sizes chosen so that no head count, head_dim, width or vocabulary coincide, GQA has fewer KV
# heads than query heads (2 of 8: at tp=4 each KV head is repeated on 2 ranks), and the layers
# hold most of the weights (the memory check).
CONFIGS = {
    "llama": lambda: T.LlamaConfig(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=12,
                                   max_position_embeddings=64, tie_word_embeddings=False),
    "mistral": lambda: T.MistralConfig(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                       num_attention_heads=12, num_key_value_heads=6, head_dim=8,
                                       max_position_embeddings=64),
    "gpt2": lambda: T.GPT2Config(vocab_size=101, n_embd=96, n_layer=2, n_head=4, n_positions=64,
                                 bos_token_id=0, eos_token_id=0),
    "gpt_neox": lambda: T.GPTNeoXConfig(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, bos_token_id=0,
                                        eos_token_id=0),
    "opt": lambda: T.OPTConfig(vocab_size=101, hidden_size=96, ffn_dim=160, num_hidden_layers=2,
                               num_attention_heads=4, word_embed_proj_dim=96, max_position_embeddings=64,
                               bos_token_id=0, eos_token_id=0, pad_token_id=1),
    "bert": lambda: T.BertConfig(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=64),
}


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    config = CONFIGS[family]()
    config._attn_implementation = "eager"
    model = T.BertForMaskedLM(config) if family == "bert" else T.AutoModelForCausalLM.from_config(config)
    return model.eval()


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(family: str, tp: int) -> dict:
    reference = build(family)
    engine = dslaunch.init_inference(copy.deepcopy(reference), tensor_parallel={"tp_size": tp},
                                     dtype=torch.float32)
    ids = torch.tensor([[5, 17, 3, 42, 8, 99, 23, 7, 64, 11]])
    with torch.no_grad():
        want, got = reference(ids).logits, engine(ids).logits
    embedding = engine.module.get_input_embeddings().weight
    result = {"max_diff": float((want - got).abs().max()), "bytes": param_bytes(engine.module),
              "full_bytes": param_bytes(reference), "allreduce": engine.allreduce_name,
              "replicated": len(engine.plan.replicated), "vocab": reference.config.vocab_size,
              "embedding_rows": embedding.shape[0],
              "tied": reference.get_output_embeddings().weight is reference.get_input_embeddings().weight,
              "tied_kept": engine.module.get_output_embeddings().weight is embedding}
    if family != "bert":
        kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
        result["same_tokens"] = reference.generate(ids, **kwargs).tolist() == engine.generate(ids, **kwargs).tolist()
    return result


def mismatch_detected(tp: int) -> bool:
    """Ranks that pass different inputs, or sample with different seeds, get an error on every
    rank, not a hang or different tokens."""
    engine = dslaunch.init_inference(build("llama"), tensor_parallel={"tp_size": tp})
    rank = torch.distributed.get_rank()
    try:
        engine(torch.tensor([[1, 2, 3] + [4] * rank]))  # even the shapes differ
        return False
    except dslaunch.DslaunchError as err:
        if "different inputs" not in str(err):
            return False
    torch.manual_seed(rank)  # same prompt, different sampling seeds
    try:
        engine.generate(torch.tensor([[1, 2, 3]]), do_sample=True, max_new_tokens=2, pad_token_id=0)
        return False
    except dslaunch.DslaunchError as err:
        return "sampling seed" in str(err)


def main() -> None:
    torch.set_num_threads(1)
    families = [a for a in sys.argv[1:] if not a.startswith("--")] or list(CONFIGS)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    results = {f"{f}@tp{t}": run(f, t) for f in families for t in dict.fromkeys((1, tp))}
    if tp > 1:
        results["mismatch_detected"] = mismatch_detected(tp)
    import deepspeed.inference.config
    import deepspeed.module_inject

    results["deepspeed_paths"] = (deepspeed.init_inference is dslaunch.init_inference
                                  and deepspeed.inference.config.DeepSpeedInferenceConfig.__module__
                                  == "dslaunch.runtime.inference.config"
                                  and deepspeed.module_inject.LinearAllreduce.__module__
                                  == "dslaunch.runtime.tensor_parallel.deepspeed_layers")
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
