"""Hugging Face BERT with its layers replaced by DeepSpeed's fused transformer layer (tiny
``BertForMaskedLM`` from a config, no download), through ``import deepspeed``. Prints ``RESULTS
{json}``: for each (hidden_act, attention implementation) the largest relative differences
between the replaced and the original model of the loss, the input-embedding gradient and every
layer-weight gradient, of the losses over 3 SGD steps, and of the output after
``revert_transformer_layer``; plus the replaced layer count and the error of a decoder BERT.

Usage: python hf_bert_fused.py
"""

from __future__ import annotations

import copy
import json

import deepspeed
import torch
import transformers as T
from deepspeed.module_inject import HFBertLayerPolicy
from transformers.models.bert.modeling_bert import BertLayer


def _config(act: str, attn: str) -> T.BertConfig:
    cfg = T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=16, hidden_act=act,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = attn
    return cfg


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 64, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, 6:] = 0
    mask[2, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(5, 64, (3, 9), generator=g)}


def compare(act: str, attn: str) -> dict:
    torch.manual_seed(0)
    cfg = _config(act, attn)
    ref = T.BertForMaskedLM(cfg)
    ref.train()
    model = deepspeed.module_inject.replace_transformer_layer(BertLayer, copy.deepcopy(ref), None, None, cfg)
    layers = [m for m in model.modules() if isinstance(m, deepspeed.DeepSpeedTransformerLayer)]
    batch = _batch(0)
    loss, ref_loss = model(**batch).loss, ref(**batch).loss
    loss.backward()
    ref_loss.backward()
    emb = model.bert.embeddings.word_embeddings.weight.grad
    ref_emb = ref.bert.embeddings.word_embeddings.weight.grad
    layer_grads = 0.0
    for ours, theirs in zip(layers, ref.bert.encoder.layer, strict=True):
        for name, tensors in HFBertLayerPolicy(theirs).parameter_map().items():
            layer_grads = max(layer_grads, _rel(getattr(ours, name).grad, torch.cat([t.grad for t in tensors])))
    steps = []
    for model_ in (model, ref):
        model_.zero_grad()
        opt = torch.optim.SGD(model_.parameters(), lr=0.5)
        losses = []
        for step in range(3):
            out = model_(**_batch(step + 1)).loss
            out.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.item())
        steps.append(losses)
    model.eval()
    ref.eval()
    with torch.no_grad():
        replaced_out = model(**_batch(7)).logits
        deepspeed.module_inject.revert_transformer_layer(BertLayer, model, cfg)
        reverted_out, ref_out = model(**_batch(7)).logits, ref(**_batch(7)).logits
    return {"layers": len(layers), "loss": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
            "embedding_grad": _rel(emb, ref_emb), "layer_grads": layer_grads,
            "steps": max(abs(a - b) / b for a, b in zip(*steps, strict=True)),
            "reverted_vs_replaced": _rel(reverted_out, replaced_out), "reverted_vs_trained_ref": _rel(reverted_out, ref_out),
            "reverted_types": sorted({type(m).__name__ for m in model.bert.encoder.layer})}


def main() -> None:
    results = {f"{act}/{attn}": compare(act, attn) for act, attn in
               (("gelu_pytorch_tanh", "eager"), ("gelu_pytorch_tanh", "sdpa"), ("gelu", "eager"))}
    decoder = _config("gelu", "eager")
    decoder.is_decoder = True
    try:
        deepspeed.replace_transformer_layer(BertLayer, T.BertModel(decoder), model_config=decoder)
        results["decoder_error"] = None
    except Exception as err:  # the one-line refusal, reported to the test
        results["decoder_error"] = f"{type(err).__name__}: {err}"
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
