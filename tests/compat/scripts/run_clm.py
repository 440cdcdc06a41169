"""transformers' examples/pytorch/language-modeling/run_clm.py, cut to its shape without the hub:
HfArgumentParser reads model, data and TrainingArguments (``--deepspeed ds_config.json``) from the
command line, then AutoConfig/AutoModelForCausalLM.from_pretrained build the model (under
``deepspeed.zero.Init`` at ZeRO 3), a text file is tokenized (bytes: no tokenizer download) and
grouped into blocks, and the Trainer trains, saves the model and evaluates.

Nothing here names dslaunch. Rank 0 prints `LOSSES <json list>` and `EVALS <json list>`: the eval losses logged, the last
one after training (of the model load_best_model_at_end loaded).

Usage: run_clm.py --model_name_or_path DIR --train_file FILE --block_size N --deepspeed CONFIG
    --output_dir DIR [any TrainingArguments flag]
"""

import json
import math
from dataclasses import dataclass, field

import torch
from trainer_gpt2 import init_deepspeed_comm_on_cpu
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a model saved with save_pretrained"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "a text file"})
    block_size: int = field(default=16, metadata={"help": "tokens per training block"})
    validation_split_percentage: int = field(default=10)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, ids: list[int], block_size: int):
        # run_clm's group_texts: concatenated tokens cut into blocks; labels are the inputs
        self.blocks = [ids[i:i + block_size] for i in range(0, len(ids) - block_size + 1, block_size)]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        ids = torch.tensor(self.blocks[i])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    init_deepspeed_comm_on_cpu()
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config)
    with open(data_args.train_file, "rb") as f:
        ids = [b % config.vocab_size for b in f.read()]
    blocks = Blocks(ids, data_args.block_size)
    n_eval = max(len(blocks) * data_args.validation_split_percentage // 100, 1)
    train = torch.utils.data.Subset(blocks, range(n_eval, len(blocks)))
    evaluation = torch.utils.data.Subset(blocks, range(n_eval))
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                      data_collator=default_data_collator)
    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(metrics["eval_loss"])
    trainer.log_metrics("eval", metrics)
    if training_args.process_index == 0:
        print("LOSSES " + json.dumps([h["loss"] for h in trainer.state.log_history if "loss" in h]), flush=True)
        print("EVALS " + json.dumps([h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]),
              flush=True)


if __name__ == "__main__":
    main()
