"""The layout cases, and their layouts as DeepSpeed's own code draws them.

``python deepspeed_layouts.py <DeepSpeed's sparsity_config.py> <out.json>`` (in a venv with torch;
DeepSpeed 0.19.8 removed sparse attention, so the file is 0.19.7's or older:
``deepspeed/ops/sparse_attention/sparsity_config.py`` of a DeepSpeed source tree, which imports
only torch and random) writes ``{case: layout digits}`` for every case of ``CASES``: seed Python's
``random`` with the case's seed, build the class with its arguments, ``make_layout(seq_len)``.
``deepspeed_layouts.json`` beside this file is its output; ``test_layouts.py`` compares
dslaunch's layouts with it (and with a fresh run where the DeepSpeed source is there).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys

#: (class name, keyword arguments, sequence length, random seed)
CASES: list[tuple[str, dict, int, int]] = [
    ("DenseSparsityConfig", {"num_heads": 2, "block": 16}, 128, 0),
    ("FixedSparsityConfig", {"num_heads": 4, "block": 16}, 256, 0),
    ("FixedSparsityConfig", {"num_heads": 4, "block": 16, "attention": "unidirectional"}, 208, 0),
    ("FixedSparsityConfig", {"num_heads": 4, "block": 8, "num_local_blocks": 4, "num_global_blocks": 2,
                             "horizontal_global_attention": True}, 200, 0),
    ("FixedSparsityConfig", {"num_heads": 4, "block": 16, "different_layout_per_head": True,
                             "num_local_blocks": 4, "num_different_global_patterns": 4}, 272, 0),
    ("FixedSparsityConfig", {"num_heads": 3, "block": 32, "different_layout_per_head": True,
                             "num_local_blocks": 6, "num_global_blocks": 2, "num_different_global_patterns": 3,
                             "attention": "unidirectional"}, 416, 0),
    ("VariableSparsityConfig", {"num_heads": 2, "block": 16}, 256, 1),
    ("VariableSparsityConfig", {"num_heads": 4, "block": 16, "different_layout_per_head": True,
                                "num_random_blocks": 2, "local_window_blocks": [2, 3, 4],
                                "global_block_indices": [0, 5, 11]}, 320, 7),
    ("VariableSparsityConfig", {"num_heads": 2, "block": 16, "num_random_blocks": 1, "local_window_blocks": [3],
                                "global_block_indices": [1, 8], "global_block_end_indices": [3, 10],
                                "attention": "unidirectional"}, 256, 3),
    ("VariableSparsityConfig", {"num_heads": 2, "block": 8, "local_window_blocks": [5, 2],
                                "global_block_indices": [2], "horizontal_global_attention": True}, 160, 4),
    ("BigBirdSparsityConfig", {"num_heads": 2, "block": 16}, 256, 0),
    ("BigBirdSparsityConfig", {"num_heads": 4, "block": 16, "different_layout_per_head": True,
                               "num_random_blocks": 3, "num_sliding_window_blocks": 5,
                               "num_global_blocks": 2}, 384, 11),
    ("BigBirdSparsityConfig", {"num_heads": 2, "block": 32, "num_random_blocks": 1,
                               "attention": "unidirectional"}, 512, 5),
    ("BSLongformerSparsityConfig", {"num_heads": 2, "block": 16}, 256, 0),
    ("BSLongformerSparsityConfig", {"num_heads": 3, "block": 16, "different_layout_per_head": True,
                                    "num_sliding_window_blocks": 5, "global_block_indices": [0, 4, 9],
                                    "global_block_end_indices": [2, 6, 30]}, 224, 0),
    ("BSLongformerSparsityConfig", {"num_heads": 2, "block": 16, "attention": "unidirectional",
                                    "global_block_indices": [3, 40]}, 256, 0),
    ("LocalSlidingWindowSparsityConfig", {"num_heads": 2, "block": 16}, 256, 0),
    ("LocalSlidingWindowSparsityConfig", {"num_heads": 2, "block": 16, "num_sliding_window_blocks": 4,
                                          "attention": "bidirectional"}, 192, 0),
]


def case_id(i: int) -> str:
    """The key of ``CASES[i]`` in the JSON file."""
    name, kwargs, seq_len, seed = CASES[i]
    return f"{i}:{name}:{seq_len}:{seed}:{json.dumps(kwargs, sort_keys=True)}"


def digits(layout) -> str:  # noqa: ANN001 (a torch tensor; torch is imported by the caller)
    """A layout as one string of its 0/1 entries, shape first: ``"H,R,C:0101..."``."""
    shape = ",".join(str(n) for n in layout.shape)
    return f"{shape}:{''.join(str(int(v)) for v in layout.flatten().tolist())}"


def layouts(module) -> dict[str, str]:  # noqa: ANN001 (the module holding the classes)
    """Every case's layout, built with ``module``'s classes."""
    out = {}
    for i, (name, kwargs, seq_len, seed) in enumerate(CASES):
        random.seed(seed)
        out[case_id(i)] = digits(getattr(module, name)(**kwargs).make_layout(seq_len))
    return out


def main(source: str, out: str) -> None:
    """Load DeepSpeed's ``sparsity_config.py`` from ``source`` and write every case's layout to ``out``."""
    spec = importlib.util.spec_from_file_location("deepspeed_sparsity_config", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(out, "w") as f:  # a test fixture, outside any user's run
        json.dump(layouts(module), f, indent=0, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
