"""The command line of ``dslaunch zero-to-fp32`` and ``python -m dslaunch.utils.zero_to_fp32``, in
one place both read: torch-free (the click command checks its arguments before importing torch), and
in the runtime (which never imports the launcher), since ``runtime.checkpoint.export.main`` parses it.
"""

from __future__ import annotations

import argparse

__all__ = ["parser"]


def parser() -> argparse.ArgumentParser:
    """The command line of ``dslaunch zero-to-fp32`` (and ``python -m dslaunch.utils.zero_to_fp32``)."""
    p = argparse.ArgumentParser(
        prog="dslaunch zero-to-fp32",
        description="Write one consolidated fp32 state dict from a dslaunch checkpoint saved at any "
                    "world size and ZeRO stage.")
    p.add_argument("checkpoint_dir", help="the save_dir of save_checkpoint, or a tag directory in it")
    p.add_argument("output", help="a directory (pytorch_model.bin, or shards plus "
                   "pytorch_model.bin.index.json, as DeepSpeed writes), or one file ending in .bin, "
                   ".pt, .pth or .safetensors (e.g. model.safetensors)")
    p.add_argument("--max_shard_size", default=None, help="directory output: largest shard, e.g. 500MB (default 5GB)")
    p.add_argument("--safe_serialization", action="store_true",
                   help="directory output: write model.safetensors (needs safetensors)")
    p.add_argument("-t", "--tag", default=None, help="tag to convert (default: latest)")
    p.add_argument("--exclude_frozen_parameters", action="store_true",
                   help="leave out parameters saved with requires_grad=False")
    return p
