"""A tiny Llama and a word-level tokenizer, built from configs (nothing downloaded) and saved to a
directory, so that TRL loads them with ``from_pretrained`` as it loads a hub model.

Words are ``w0`` ... ``w59``: sentences are those words separated by spaces.

Usage: tiny_lm.py DIR
"""

import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = 60
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + [f"w{i}" for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main() -> None:
    out = sys.argv[1]
    tok = tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    main()
