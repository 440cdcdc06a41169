"""TRL's SFTTrainer with DeepSpeed's sequence parallelism as TRL documents it: ``SFTConfig(
parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=SP, ...), deepspeed=<Hugging
Face's config with "auto">)``, the tiny Llama saved by tiny_lm.py (2 heads, sdpa), full fine-tuning
on 12-token rows padded to a multiple of SP, SGD (unlike Adam, its steps show a gradient's scale),
in fp32: ``bf16=False``, since SFTConfig defaults to bf16 mixed precision, where each rank's weight
gradients, summed over its shard's tokens only, are rounded to bf16 before the ranks add them (as
with any data-parallel split): 3e-3 relative per tensor at sp=2 against sp=1, 9e-5 on the norm.
Nothing here names dslaunch. Rank 0 prints ``LOSSES <json list of the logged losses>`` and
``GRAD_NORMS <json list>``.

Usage: trl_sft_ulysses.py MODEL_DIR OUTPUT_DIR SP STAGE MAX_STEPS
"""

import json
import sys

from accelerate.utils import ParallelismConfig
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
from datasets import Dataset
from trainer_gpt2 import ds_config
from trl import SFTConfig, SFTTrainer
from trl_sft import SEQ, token_rows


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    model_dir, out, sp, stage, max_steps = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    parallelism = None
    if sp > 1:
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    config = {**ds_config(stage), "optimizer": {"type": "SGD", "params": {"lr": "auto"}}}
    del config["scheduler"]
    args = SFTConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     max_steps=max_steps, learning_rate=1.0, lr_scheduler_type="constant", logging_steps=1,
                     save_strategy="no", report_to=[], deepspeed=config, use_cpu=True, seed=0, disable_tqdm=True,
                     dataloader_num_workers=0, max_length=SEQ, pad_to_multiple_of=sp, parallelism_config=parallelism,
                     bf16=False)
    trainer = SFTTrainer(model=model_dir, args=args, train_dataset=Dataset.from_dict({"input_ids": token_rows(64)}))
    trainer.train()
    if trainer.args.process_index == 0:
        logged = [h for h in trainer.state.log_history if "loss" in h]
        print("LOSSES " + json.dumps([h["loss"] for h in logged]), flush=True)
        print("GRAD_NORMS " + json.dumps([h["grad_norm"] for h in logged]), flush=True)


if __name__ == "__main__":
    main()
