"""A tiny GPT-2 and a word-level tokenizer, built from configs (nothing downloaded) and saved to a
directory, so that an example script loads them with ``from_pretrained`` as it loads a hub model.

The vocabulary holds the words of DeepSpeedExamples' text-generation prompts; others are ``<unk>``.
That example calls ``tokenizer.batch_encode_plus``, which transformers 5 removed: the directory
carries its tokenizer as remote code (``tokenization_tiny.py``, loaded with the example's own
``--trust_remote_code``) whose class still has it, as a hub model written for transformers 4 would.

Usage: tiny_gpt2.py DIR
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

WORDS = ("DeepSpeed is a machine learning framework He working on has got all Everyone happy and I can The "
         "new movie that Oscar this year In the far distance from our galaxy, Peace only way").split()
SPECIAL = ["<eos>", "<unk>"]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(SPECIAL + list(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def main() -> None:
    out = sys.argv[1]
    tok = tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    (Path(out) / "tokenization_tiny.py").write_text(REMOTE_TOKENIZER)
    config = Path(out) / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyTokenizerFast"]}
    config.write_text(json.dumps(settings))


REMOTE_TOKENIZER = """
from transformers import PreTrainedTokenizerFast


class TinyTokenizerFast(PreTrainedTokenizerFast):
    def batch_encode_plus(self, batch, **kwargs):  # transformers 4's name for a batch call
        return self(batch, **kwargs)
"""


if __name__ == "__main__":
    main()
