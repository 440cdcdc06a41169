"""A TRL SFT job as users write it: SFTConfig(deepspeed=<Hugging Face's config with "auto">,
use_cpu=True), the tiny Llama saved by tiny_lm.py, full fine-tuning or LoRA (PEFT), then a reload
of what ``save_model`` wrote: the whole model, or the adapter on top of the base model.

Nothing here names dslaunch: run it with `deepspeed`/`dslaunch` or `torchrun`. Rank 0 prints
`LOSSES <json list of the logged losses>` and `RELOADED <loss of the reloaded model on a fixed batch>`.

Usage: trl_sft.py MODEL_DIR OUTPUT_DIR STAGE full|lora MAX_STEPS
"""

import json
import sys

import torch
from datasets import Dataset
from trainer_gpt2 import ds_config, init_deepspeed_comm_on_cpu
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

SEQ = 12


def token_rows(n: int, vocab_from: int = 3, words: int = 60) -> list[list[int]]:
    """Learnable rows: each counts up (modulo the words) from a random start."""
    starts = torch.randint(0, words, (n,), generator=torch.Generator().manual_seed(1))
    return [[vocab_from + (int(s) + k) % words for k in range(SEQ)] for s in starts]


def reloaded_loss(model_dir: str, saved: str, lora: bool) -> float:
    """The loss on a fixed batch of the model rebuilt from disk, as a user reloads it: in a process
    of its own, that is without the ZeRO-3 config the Trainer made active (rank 0 alone would
    otherwise build it under zero.Init, whose collectives need every rank)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), saved)
    else:
        model = AutoModelForCausalLM.from_pretrained(saved)
    ids = torch.tensor(token_rows(8)[:4])
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # DeepSpeed's launchers add it
    model_dir, out, stage, mode, max_steps = argv[0], argv[1], int(argv[2]), argv[3], int(argv[4])
    init_deepspeed_comm_on_cpu()  # recording with the real DeepSpeed at ZeRO 3 only (see there)
    lora = mode == "lora"
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")
    args = SFTConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     max_steps=max_steps, learning_rate=1e-2 if lora else 3e-3, warmup_steps=1, logging_steps=1,
                     save_strategy="no", report_to=[], deepspeed=ds_config(stage), use_cpu=True, seed=0,
                     disable_tqdm=True, dataloader_num_workers=0, max_length=SEQ)
    data = Dataset.from_dict({"input_ids": token_rows(64)})
    trainer = SFTTrainer(model=model_dir, args=args, train_dataset=data, peft_config=peft_config)
    trainer.train()
    saved = f"{out}/final"
    trainer.save_model(saved)
    trainer.accelerator.wait_for_everyone()
    if trainer.args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print("LOSSES " + json.dumps(losses), flush=True)
        print("RELOADED " + json.dumps(reloaded_loss(model_dir, saved, lora)), flush=True)


if __name__ == "__main__":
    main()
