"""A Hugging Face Trainer job as users write it: a DeepSpeed config with "auto" values in
TrainingArguments, a tiny GPT-2 built from a config (nothing downloaded), synthetic tokens.

Nothing here names dslaunch: run it with `deepspeed`/`dslaunch` or `torchrun`. Rank 0 prints one
line `LOSSES <json list of the logged losses>`.

Usage: trainer_gpt2.py OUTPUT_DIR MAX_STEPS STAGE [resume] [OPTION ...]
  build=config: the model is built by AutoModelForCausalLM.from_config after TrainingArguments (at
      ZeRO 3 transformers then builds it under deepspeed.zero.Init); build=DIR: from_pretrained(DIR)
      likewise. Without it the model is built before TrainingArguments (plain torch).
  only_model: save_only_model=True.
  final=DIR: trainer.save_model(DIR) after training.
  save_model=DIR: only save the tiny model (seed 0) to DIR with save_pretrained, for build=DIR.
  autotp=N: "tensor_parallel": {"autotp_size": N} in the config (AutoTP training); dropout off
      (a tensor slice draws its own attention-dropout mask: only without dropout can the losses
      equal an unsharded run's).
  autoep=N: a tiny Mixtral (4 experts, top-2, with its router's auxiliary loss) instead of GPT-2,
      and "expert_parallel": {"enabled": true, "autoep_size": N} in the config (AutoEP); rank 0
      also prints `CONVERTED <MoE blocks the engine's model holds in expert-parallel form>`; with
      final=DIR, `RELOADED` (reload_autoep: the saved model against the engine's).
"""

import json
import os
import sys

import torch
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    MixtralForCausalLM,
    Trainer,
    TrainingArguments,
)

VOCAB, SEQ = 128, 16


class Tokens(Dataset):
    def __init__(self, n: int):
        # learnable: each sequence counts up from a random start, so the loss falls within steps
        starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(1))
        self.ids = (starts + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(stage: int) -> dict:
    zero3 = {"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
             "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
             "stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {}
    return {  # the shape of Hugging Face's documented ZeRO-2 (and ZeRO-3) config
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
                              "contiguous_gradients": True, **zero3},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def init_deepspeed_comm_on_cpu() -> None:
    """With DS_INIT_BEFORE_MODEL=1 only (recording with the real DeepSpeed on CPU): use_cpu=True lets
    accelerate start torch.distributed, not deepspeed.comm, and DeepSpeed's zero.Init then reads a
    world size of 1 and fails its batch-size check; dslaunch reads torch.distributed's."""
    if os.environ.get("DS_INIT_BEFORE_MODEL") == "1":
        import deepspeed

        deepspeed.init_distributed()


def gpt2_config(dropout: float | None = None) -> GPT2Config:
    off = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, **off)


def reload_autoep(trainer: Trainer, folder: str) -> None:
    """Rank 0 prints `RELOADED {"diff": ..., "problems": ...}`: the saved model loaded with
    from_pretrained into the unconverted Mixtral class (the loading info's missing, unexpected or
    mismatched keys) and its logits against the trained engine's model on one batch."""
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = trainer.model_wrapped.module.eval()(input_ids=x).logits  # collective: the experts' all-to-all
    if trainer.args.process_index == 0:
        model, info = MixtralForCausalLM.from_pretrained(folder, output_loading_info=True)
        with torch.no_grad():
            got = model.eval()(input_ids=x).logits
        problems = {k: list(v) for k, v in info.items() if v}
        print("RELOADED " + json.dumps({"diff": (got - want).abs().max().item(), "problems": problems}), flush=True)


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # DeepSpeed's launchers add it
    opts = dict(a.split("=", 1) if "=" in a else (a, "") for a in argv[3:])
    torch.manual_seed(0)
    if "save_model" in opts:
        GPT2LMHeadModel(gpt2_config()).save_pretrained(opts["save_model"])
        return
    out, max_steps, stage = argv[0], int(argv[1]), int(argv[2])
    build = opts.get("build")
    config = ds_config(stage)
    if "autotp" in opts:
        config["tensor_parallel"] = {"autotp_size": int(opts["autotp"])}
    if "autoep" in opts:
        config["expert_parallel"] = {"enabled": True, "autoep_size": int(opts["autoep"])}
    model = GPT2LMHeadModel(gpt2_config(0.0 if "autotp" in opts else None)) if build is None else None
    if "autoep" in opts:
        model = MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 max_position_embeddings=SEQ, output_router_logits=True))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=max_steps, learning_rate=3e-3, warmup_steps=2, logging_steps=1,
                             save_strategy="steps", save_steps=max(max_steps // 2, 1), report_to=[],
                             deepspeed=config, use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0, save_only_model="only_model" in opts)
    if build is not None:
        init_deepspeed_comm_on_cpu()
    if build == "config":  # after TrainingArguments: transformers sees the ZeRO-3 config (zero.Init)
        model = AutoModelForCausalLM.from_config(gpt2_config())
    elif build is not None:
        model = AutoModelForCausalLM.from_pretrained(build)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(256))
    trainer.train(resume_from_checkpoint=True if "resume" in opts else None)
    if "final" in opts:
        trainer.save_model(opts["final"])
        if "autoep" in opts:
            reload_autoep(trainer, opts["final"])
    if trainer.args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print("LOSSES " + json.dumps(losses), flush=True)
        if "autoep" in opts:
            blocks = [m for m in trainer.model_wrapped.module.modules() if type(m).__name__ == "AutoEPMoE"]
            print(f"CONVERTED {len(blocks)}", flush=True)


if __name__ == "__main__":
    main()
