"""``install_chunked_causal_lm_loss`` on a real Hugging Face causal LM (transformers in the compat
venv): the model's loss and gradients stay what its stock ``ForCausalLMLoss`` gives."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

_SCRIPT = r"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from deepspeed.runtime.chunked_cross_entropy import ChunkedCausalLMLoss, install_chunked_causal_lm_loss

torch.manual_seed(0)
config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 97, (2, 9))
labels = ids.clone()
labels[0, :3] = -100

def run():
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), [p.grad.clone() for p in model.parameters()]

stock, stock_grads = run()
installed = install_chunked_causal_lm_loss(model, block_rows=4)
assert isinstance(installed, ChunkedCausalLMLoss) and model.loss_function is installed
ours, our_grads = run()
assert torch.allclose(ours, stock, rtol=1e-6, atol=1e-6), (ours, stock)
assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(our_grads, stock_grads))
try:
    install_chunked_causal_lm_loss(model)
except ValueError as exc:
    assert "replaces transformers' ForCausalLMLoss only" in str(exc), exc
else:
    raise AssertionError("a second install was accepted")
print("SAME LOSS", float(ours), float(stock))
"""


@pytest.mark.timeout(120)
def test_a_llama_trains_with_the_same_loss(compat_bin: Path) -> None:
    proc = subprocess.run([str(compat_bin / "python"), "-c", _SCRIPT], capture_output=True, text=True, timeout=110,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "SAME LOSS" in proc.stdout, proc.stdout + proc.stderr[-3000:]
