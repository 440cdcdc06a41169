"""A TRL DPO job with a reference model: DPOConfig(deepspeed=<Hugging Face's config with "auto">,
use_cpu=True), the tiny Llama saved by tiny_lm.py as policy and reference. TRL builds the
reference engine itself (``prepare_deepspeed``: the Trainer's config, its "auto" values not yet
filled, dotted ``zero_optimization.*`` keys added at stage 3, stage 0 below it).

Nothing here names dslaunch. Rank 0 prints `LOSSES <json list of the logged losses>`.

Usage: trl_dpo.py MODEL_DIR OUTPUT_DIR STAGE MAX_STEPS
"""

import json
import sys

import torch
from datasets import Dataset
from trainer_gpt2 import ds_config, init_deepspeed_comm_on_cpu
from trl import DPOConfig, DPOTrainer


def pairs(n: int, words: int = 60) -> dict[str, list[str]]:
    """A prompt of three counting words; chosen continues the count, rejected repeats the last word."""
    g = torch.Generator().manual_seed(2)
    starts = [int(s) for s in torch.randint(0, words, (n,), generator=g)]
    word = lambda i: f"w{i % words}"  # noqa: E731
    return {"prompt": [" ".join(word(s + k) for k in range(3)) for s in starts],
            "chosen": [" " + " ".join(word(s + k) for k in range(3, 5)) for s in starts],
            "rejected": [" " + " ".join(word(s + 2) for _ in range(2)) for s in starts]}


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # DeepSpeed's launchers add it
    model_dir, out, stage, max_steps = argv[0], argv[1], int(argv[2]), int(argv[3])
    init_deepspeed_comm_on_cpu()  # recording with the real DeepSpeed at ZeRO 3 only (see there)
    args = DPOConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                     max_steps=max_steps, learning_rate=1e-2, warmup_steps=1, logging_steps=1, beta=0.1,
                     save_strategy="no", report_to=[], deepspeed=ds_config(stage), use_cpu=True, seed=0,
                     disable_tqdm=True, dataloader_num_workers=0, max_length=16)
    trainer = DPOTrainer(model=model_dir, args=args, train_dataset=Dataset.from_dict(pairs(32)))
    assert trainer.ref_model is not None and type(trainer.ref_model).__name__ == "DeepSpeedEngine"
    trainer.train()
    if trainer.args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print("LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
