"""A Hugging Face Trainer job with accelerate's ``ParallelismConfig(sp_backend="deepspeed",
sp_size=SP)`` as its documentation shows it: a tiny random Llama (4 heads, 1 key/value head,
sdpa) built from a config, a DeepSpeed config with "auto" values, 63-token sequences. Nothing
here names dslaunch. Rank 0 prints ``LOSSES <json list of the logged losses>``.

Usage: trainer_ulysses.py OUTPUT_DIR SP STAGE MAX_STEPS
"""

import json
import sys

import torch
from accelerate.utils import ParallelismConfig
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, LENGTH = 32, 63


class Counting(Dataset):
    """Tokens counting up from a random start (learnable); the first 5 labels are a prompt."""

    def __init__(self, n: int):
        starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(1))
        self.ids = (starts + torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        labels[:5] = -100
        return {"input_ids": self.ids[i], "labels": labels, "position_ids": torch.arange(LENGTH)}


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, sp, stage, steps = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                                         tie_word_embeddings=False, attn_implementation="sdpa"))
    ds_config = {"zero_optimization": {"stage": stage}, "train_batch_size": "auto",
                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {
                     "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}}
    parallelism = None
    if sp > 1:
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length=LENGTH, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-2,
                             lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                             deepspeed=ds_config, use_cpu=True, parallelism_config=parallelism, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Counting(64))
    trainer.train()
    if trainer.is_world_process_zero():
        print("LOSSES", json.dumps([e["loss"] for e in trainer.state.log_history if "loss" in e]), flush=True)


if __name__ == "__main__":
    main()
