"""``SparseAttentionUtils`` on a BERT-shaped model, and the ds_config ``sparse_attention`` section."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dslaunch.errors import ConfigError, SparsityConfigError
from dslaunch.ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparseAttentionUtils,
)
from dslaunch.runtime.config.ds_config import load_config
from tests.runtime.sparse_attention.models import TinyBert


@pytest.mark.timeout(30)
def test_replacing_the_attention_keeps_the_projections_and_dense_layout_keeps_the_loss() -> None:
    torch.manual_seed(0)
    model = TinyBert()
    ids, labels = torch.randint(0, 32, (2, 32)), torch.randint(0, 32, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, -6:] = 0
    before = model(ids, mask, labels)
    projections = [layer.attention.self.query for layer in model.bert.encoder.layer]
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 48, DenseSparsityConfig(num_heads=2, block=16))
    for layer, query in zip(model.bert.encoder.layer, projections, strict=True):
        assert isinstance(layer.attention.self, BertSparseSelfAttention) and layer.attention.self.query is query
    assert model.config.max_position_embeddings == 48
    torch.testing.assert_close(model(ids, mask, labels), before, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(30)
def test_pad_to_block_size_and_unpad() -> None:
    ids = torch.arange(2 * 20).view(2, 20)
    mask, types, positions = torch.ones(2, 20, dtype=torch.long), torch.ones(2, 20, dtype=torch.long), ids.clone()
    emb = nn.Embedding(64, 4)
    pad, ids2, mask2, types2, pos2, embeds = SparseAttentionUtils.pad_to_block_size(
        16, ids, mask, types, positions, None, 0, emb)
    assert pad == 12 and ids2.shape == (2, 32) and embeds is None
    assert ids2[:, 20:].eq(0).all() and mask2[:, 20:].eq(0).all() and types2[:, 20:].eq(0).all()
    assert pos2[:, 20:].eq(0).all() and torch.equal(ids2[:, :20], ids)
    pad, _, _, _, _, embeds = SparseAttentionUtils.pad_to_block_size(16, None, mask, types, None, emb(ids), 5, emb)
    assert embeds.shape == (2, 32, 4) and torch.equal(embeds[:, 20:], emb(torch.full((2, 12), 5)))
    out = torch.randn(2, 32, 4)
    assert torch.equal(SparseAttentionUtils.unpad_sequence_output(pad, out), out[:, :20])
    assert SparseAttentionUtils.unpad_sequence_output(0, out) is out
    assert SparseAttentionUtils.pad_to_block_size(16, ids2, mask2, types2, None, None, 0, emb)[0] == 0


@pytest.mark.timeout(30)
def test_extend_position_embedding_repeats_the_trained_rows() -> None:
    model = TinyBert(positions=16)
    trained = model.bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 48)
    assert torch.equal(model.bert.embeddings.position_embeddings.weight, trained.repeat(3, 1))
    assert model.config.max_position_embeddings == 48
    roberta = SimpleNamespace(roberta=model.bert, config=SimpleNamespace())
    rows = model.bert.embeddings.position_embeddings.weight.detach().clone()  # 48 = 2 reserved + 46
    SparseAttentionUtils.extend_position_embedding(roberta, 100)
    new = model.bert.embeddings.position_embeddings.weight
    assert new.shape == (102, 4 * 8) and roberta.config.max_position_embeddings == 102
    assert torch.equal(new[:2], rows[:2]) and torch.equal(new[2:48], rows[2:]) and torch.equal(new[48:94], rows[2:])
    assert new[94:].eq(0).all()  # DeepSpeed leaves these uninitialised
    with pytest.raises(SparsityConfigError, match="must be above the current 48"):
        SparseAttentionUtils.extend_position_embedding(TinyBert(positions=48), 40)
    with pytest.raises(SparsityConfigError, match="'bert' or 'roberta'"):
        SparseAttentionUtils.extend_position_embedding(nn.Linear(1, 1), 40)
    tokenizer = SimpleNamespace(model_max_length=16, init_kwargs={})
    assert SparseAttentionUtils.update_tokenizer_model_max_length(tokenizer, 48).init_kwargs == {"model_max_length": 48}


def _config(section: dict) -> object:
    return load_config({"train_batch_size": 8, "sparse_attention": section}, 1).sparse_attention


@pytest.mark.timeout(30)
def test_the_section_parses_into_deepspeeds_dict_and_builds_the_layout() -> None:
    assert load_config({"train_batch_size": 8}, 1).sparse_attention is None
    cfg = _config({})
    assert cfg.as_dict() == {"mode": "fixed", "block": 16, "different_layout_per_head": False, "num_local_blocks": 4,
                             "num_global_blocks": 1, "attention": "bidirectional",
                             "horizontal_global_attention": False, "num_different_global_patterns": 1}
    built = cfg.sparsity_config(num_heads=4)
    assert isinstance(built, FixedSparsityConfig)
    assert torch.equal(built.make_layout(128), FixedSparsityConfig(4).make_layout(128))
    big = _config({"mode": "bigbird", "block": 32, "num_random_blocks": 2, "num_global_blocks": 2})
    assert big.as_dict() == {"mode": "bigbird", "block": 32, "different_layout_per_head": False, "num_random_blocks": 2,
                             "num_sliding_window_blocks": 3, "num_global_blocks": 2}
    layout = big.sparsity_config(2)
    assert isinstance(layout, BigBirdSparsityConfig) and (layout.block, layout.num_random_blocks) == (32, 2)
    var = _config({"mode": "variable", "local_window_blocks": [2, 4], "global_block_indices": [0, 3],
                   "global_block_end_indices": [1, 5]})
    assert var.as_dict()["local_window_blocks"] == [2, 4] and var.sparsity_config(2).global_block_end_indices == [1, 5]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("section, words", [
    ({"mode": "fixd"}, "'sparse_attention.mode': must be one of dense, fixed, variable, bigbird, bslongformer"),
    ({"num_local_block": 4}, "(did you mean 'num_local_blocks'?)"),
    ({"block": 0}, "'sparse_attention.block': must be an integer in [1"),
    ({"num_local_blocks": 3, "num_global_blocks": 2}, "num_local_blocks=3 is not a multiple of num_global_blocks=2"),
    ({"mode": "variable", "global_block_indices": [2], "global_block_end_indices": [1, 4]}, "one end per start"),
    ({"attention": "unidirectional", "horizontal_global_attention": True}, "needs attention='bidirectional'"),
    ({"local_window_blocks": 4}, "'sparse_attention.local_window_blocks': must be a list of integers"),
])
def test_bad_sections_fail_in_one_line_naming_the_key(section: dict, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(section)
    assert words in str(info.value) and "\n" not in str(info.value)
