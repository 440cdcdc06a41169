"""Model shapes: Hugging Face configs counted exactly (GPT-2 small, Llama-2-7B), modules on the meta
device (tied weights once), builders named MODULE:FUNCTION, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslaunch.errors import UsageError
from dslaunch.runtime.estimate import ModelShape, from_builder, from_hf_config, from_module

pytestmark = pytest.mark.timeout(60)

GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
        "n_positions": 1024, "n_inner": None, "activation_function": "gelu_new"}
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "hidden_act": "silu",
             "tie_word_embeddings": False}
LLAMA3_8B = {**LLAMA2_7B, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


def _config(tmp_path: Path, name: str, cfg: dict) -> str:
    (tmp_path / name).mkdir()
    path = tmp_path / name / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("name, cfg, params, largest", [
    ("gpt2", GPT2, 124_439_808, 50257 * 768),          # transformers' GPT2LMHeadModel, tied head
    ("llama-2-7b", LLAMA2_7B, 6_738_415_616, 32000 * 4096),
    ("llama-3-8b", LLAMA3_8B, 8_030_261_248, 128256 * 4096),  # grouped-query attention
])
def test_hf_config_counts_the_published_parameter_counts(tmp_path, name, cfg, params, largest) -> None:
    shape = from_hf_config(_config(tmp_path, name, cfg))
    assert (shape.params, shape.largest_layer, shape.name) == (params, largest, name)
    assert shape.transformer and shape.hidden == cfg.get("hidden_size", cfg.get("n_embd"))
    assert sum(shape.param_sizes) == params


def test_hf_config_errors_name_the_file_and_what_is_missing(tmp_path) -> None:
    with pytest.raises(UsageError, match="nope.json: cannot read: No such file"):
        from_hf_config(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match=r"bad.json:1: not valid JSON \(Expecting property name"):
        from_hf_config(str(bad))
    with pytest.raises(UsageError, match="no num_hidden_layers"):
        from_hf_config(_config(tmp_path, "x", {"hidden_size": 8, "vocab_size": 10}))


def test_module_on_the_meta_device_counts_tied_weights_once() -> None:
    import torch

    with torch.device("meta"):
        emb = torch.nn.Embedding(1000, 64)
        head = torch.nn.Linear(64, 1000, bias=False)
        head.weight = emb.weight
        model = torch.nn.Sequential(emb, torch.nn.Linear(64, 256), head)
        model.register_buffer("mask", torch.ones(16, dtype=torch.bool))
    shape = from_module(model)
    assert shape.params == 1000 * 64 + 64 * 256 + 256
    assert shape.largest_layer == 1000 * 64 and shape.buffer_bytes == 16
    assert sorted(shape.param_sizes) == [256, 64 * 256, 1000 * 64]


def test_builder_is_called_on_the_meta_device(tmp_path, monkeypatch) -> None:
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def build():\n"
        "    m = torch.nn.Linear(4096, 4096)\n"
        "    assert m.weight.device.type == 'meta'\n"
        "    return m\n"
        "def not_a_module():\n"
        "    return 3\n"
        "def needs_args(width):\n"
        "    return torch.nn.Linear(width, width)\n")
    monkeypatch.chdir(tmp_path)
    assert from_builder("mymodels:build").params == 4096 * 4096 + 4096
    for spec, message in [("mymodels", "expected MODULE:FUNCTION"), ("nosuchmod:build", "cannot import"),
                          ("mymodels:missing", "has no function missing"), ("mymodels:not_a_module", "returned int"),
                          ("mymodels:needs_args", "needs_args\\(\\) raised TypeError")]:
        with pytest.raises(UsageError, match=message):
            from_builder(spec)


def test_shape_rejects_impossible_counts() -> None:
    with pytest.raises(UsageError, match="params must be a positive"):
        ModelShape(params=0)
    with pytest.raises(UsageError, match="largest_layer"):
        ModelShape(params=10, largest_layer=11)
