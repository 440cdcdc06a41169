"""An accelerate training loop as users write it: ``Accelerator`` with a ``DeepSpeedPlugin``
(ZeRO from a config with "auto" values), a client AdamW, a tiny GPT-2 built from a config and
synthetic tokens. ``save_state``/``load_state`` checkpoint and resume.

Nothing here names dslaunch. Rank 0 prints one line `LOSSES <json list>`: its loss at each optimizer step's last micro batch.

Usage: accelerate_gpt2.py OUTPUT_DIR STEPS STAGE [SAVE_AT | resume:K | init]
  SAVE_AT: save_state(OUTPUT_DIR/state) after that many optimizer steps.
  resume:K: load_state(OUTPUT_DIR/state) and continue from optimizer step K.
  init: the plugin's zero3_init_flag is set and the model is built by AutoModelForCausalLM.from_config
      after the Accelerator (at ZeRO 3 transformers then builds it under deepspeed.zero.Init).
"""

import json
import sys

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, GAS = 128, 16, 2


def main() -> None:
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # DeepSpeed's launchers add it
    out, steps, stage = argv[0], int(argv[1]), int(argv[2])
    mode = argv[3] if len(argv) > 3 else ""
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "overlap_comm": True},
        "steps_per_print": 1000}, zero3_init_flag=mode == "init")
    # No cpu=True: accelerate would then train with DDP and leave DeepSpeed out (it picks the CPU anyway)
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    # No dropout: accelerate's save_state keeps only rank 0's RNG state, so with dropout a resumed
    # run differs from an uninterrupted one (under DeepSpeed as under dslaunch).
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = AutoModelForCausalLM.from_config(config) if mode == "init" else GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    starts = torch.randint(0, VOCAB, (256, 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset((starts + torch.arange(SEQ)) % VOCAB), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert type(model).__name__ == "DeepSpeedEngine", type(model)
    first = 0
    if mode.startswith("resume:"):
        accelerator.load_state(f"{out}/state")
        first = int(mode.split(":")[1])
        loader = accelerator.skip_first_batches(loader, first * GAS)
    losses, step = [], first
    model.train()
    for (ids,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            losses.append(loss.item())  # this rank's last micro batch
            if mode.isdigit() and step == int(mode):
                accelerator.save_state(f"{out}/state")
            if step == steps:
                break
    if accelerator.is_main_process:
        print("LOSSES " + json.dumps(losses), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
