"""``dslaunch zero-to-fp32 CHECKPOINT_DIR OUTPUT``: one consolidated fp32 state dict from a checkpoint.

Owns the offline export (like DeepSpeed's ``zero_to_fp32.py``): the ZeRO shards of any world
size and stage are concatenated into full fp32 master weights and split per parameter; buffers
and parameters the optimizer did not hold (frozen ones) come from the saved module file. The
result is a plain ``{name: tensor}`` dict in the module's ``state_dict`` order, loadable with
``model.load_state_dict``.

Resuming training never needs this step: ``engine.load_checkpoint`` reshards at load time.
"""

from __future__ import annotations

import argparse
import os
from collections import OrderedDict
from pathlib import Path

import torch

from dslaunch.errors import CheckpointError, UsageError
from dslaunch.runtime.checkpoint_engine import MODULE_FILE, zero_file
from dslaunch.runtime.checkpoint_io import MANIFEST, CheckpointStore, first_loadable
from dslaunch.runtime.checkpoint_reshard import assemble, fp32_params, needed_ranks

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "main"]


def _store_and_tag(checkpoint_dir: str | os.PathLike, tag: str | None) -> tuple[CheckpointStore, str | None]:
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise CheckpointError("not a directory (expected a save_dir or one of its tag directories)",
                              str(path))
    if (path / MANIFEST).is_file() and tag is None:  # a tag directory itself
        return CheckpointStore(path.parent), path.name
    return CheckpointStore(path), tag


def _consolidate(store: CheckpointStore, tag: str) -> OrderedDict[str, torch.Tensor]:
    manifest = store.manifest(tag)
    pmap = manifest.meta["partition"]
    full = [(0, int(g["numel"])) for g in pmap["groups"]]
    shards = [store.read(tag, zero_file(r), manifest) for r in needed_ranks(pmap, full)]
    masters = fp32_params(assemble(shards, full))
    module = store.read(tag, MODULE_FILE, manifest)["module"]
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name in manifest.meta.get("module_keys", list(module)):  # the module's state_dict order
        if name in masters:
            out[name] = masters.pop(name)
        elif torch.is_tensor(module.get(name)):
            value = module[name]
            out[name] = value.float().clone() if value.is_floating_point() else value.clone()
    out.update(masters)
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None
                                             ) -> OrderedDict[str, torch.Tensor]:
    """The consolidated fp32 state dict of a checkpoint (any world size, ZeRO stage 0-2).

    Args:
        checkpoint_dir: the ``save_dir`` given to ``save_checkpoint``, or one tag directory.
        tag: which tag; None: the one ``latest`` names, else the newest valid one.
    Raises:
        CheckpointError naming the directory or the missing/corrupt file.
    """
    store, tag = _store_and_tag(checkpoint_dir, tag)
    if tag is not None:
        return _consolidate(store, tag)
    tags, notes = store.candidates()
    found = first_loadable(tags, lambda t: _consolidate(store, t))
    if found is None:
        raise CheckpointError("no checkpoint here (" + ("; ".join(notes) or "no tags") + ")",
                              str(store.root))
    return found[1]


def _write(state: OrderedDict[str, torch.Tensor], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
    if output.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise UsageError(f"{output}: writing .safetensors needs the safetensors package "
                             "(pip install safetensors), or name the output *.pt") from None
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    else:
        torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, output)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike,
                                               output_file: str | os.PathLike,
                                               tag: str | None = None) -> Path:
    """Write the consolidated fp32 state dict to ``output_file`` (.pt, or .safetensors)."""
    output = Path(output_file)
    _write(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), output)
    return output


def main(argv: list[str] | None = None) -> int:
    """``dslaunch zero-to-fp32 CHECKPOINT_DIR OUTPUT [--tag TAG]``; DslaunchError on bad input."""
    parser = argparse.ArgumentParser(
        prog="dslaunch zero-to-fp32",
        description="Write one consolidated fp32 state dict from a dslaunch checkpoint saved at "
                    "any world size and ZeRO stage. OUTPUT ending in .safetensors is written with "
                    "safetensors, anything else with torch.save.")
    parser.add_argument("checkpoint_dir", help="the save_dir of save_checkpoint, or a tag directory in it")
    parser.add_argument("output_file", help="where to write, e.g. pytorch_model.bin or model.safetensors")
    parser.add_argument("-t", "--tag", default=None, help="tag to convert (default: latest)")
    args = parser.parse_args(argv)
    out = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    import sys

    from dslaunch.errors import DslaunchError

    try:
        sys.exit(main())
    except DslaunchError as err:
        print(f"zero-to-fp32: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
