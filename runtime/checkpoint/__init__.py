"""``dslaunch.runtime.checkpoint``: engine checkpoints and their offline export.

Owns what goes into a tag (``save_load.py``: ``save_checkpoint``,
``load_checkpoint``, ``save_16bit_model``, ``wait_for_checkpoint``, which the engine's methods
call) and what each rank reads of it on load (``load_plan.py``), the named parts a checkpoint holds, each with its ``state_dict`` (``parts.py``), the
per-engine machinery and file names (``checkpointer.py``), the on-disk format of one
file (``format.py``), the checkpoint directory with its manifests, ``latest`` and retention
(``store.py``), the leader's publication steps (``publish.py``) and what killed saves leave
(``leftovers.py``), the collective save protocol
and background writer (``writer.py``), resharding ZeRO state between world sizes and stages
(``reshard.py``), the parts of model-parallel engines named by topology coordinates
(``model_parallel.py``), the offline fp32 export, DeepSpeed's ``zero_to_fp32`` (``export.py``), and
loading checkpoints real DeepSpeed wrote (``deepspeed_layout.py`` names its files,
``deepspeed_read.py`` reads them into whole per-parameter state, ``deepspeed_load.py`` places it;
a pipeline's, one file per layer and a set per stage: ``deepspeed_pipe.py``; AutoTP's, a set per
tensor-parallel rank joined by DeepSpeed's slice map: ``deepspeed_tp.py``; its bf16 optimizer's,
``BF16_Optimizer``'s padded partitions named by its slice mappings: ``deepspeed_bf16.py``),
writing them (``deepspeed_write.py``, with DeepSpeed's own classes pickled by name:
``deepspeed_pickle.py``; an AutoTP engine's re-cut as DeepSpeed's AutoTP cuts: ``deepspeed_tp_write.py``,
the cut and its slice map: ``deepspeed_tp_cuts.py``), DeepSpeed's MoE files, one per global expert (``deepspeed_experts.py``), and its AutoEP blocks' names and
``ds_autoep_layers`` metadata (``deepspeed_autoep.py``; at ZeRO-3 its ``zero3_partitioned``
records: ``deepspeed_autoep_zero3.py``),
and DeepSpeed's universal checkpoints both ways (``universal.py``; AutoEP tags in dslaunch's own layout
made universal: ``universal_autoep.py``; AutoTP tags' slices joined into it by DeepSpeed's slice records: ``universal_tp.py``, the per-parameter join and cut: ``autotp_universal.py``; one parameter restored from it: ``universal_restore.py``); ``deepspeed.checkpoint``'s
file-by-file reading of a tag, as Megatron-DeepSpeed's converters do (``deepspeed_checkpoint.py``:
``DeepSpeedCheckpoint``; ``deepspeed_zero_files.py``: ``ZeROCheckpoint``; ``deepspeed_reshape.py``:
the 2D/3D maps and ``merge_state``; ``deepspeed_metadata.py``: the files' saved shape;
``deepspeed_constants.py``: its key strings); expert parameters named by
global expert and moved to another expert-parallel layout on load (``experts.py``); snapshots in host memory,
replicated to a peer host, that a restart resumes from (``memory.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["save_checkpoint", "load_checkpoint", "save_16bit_model", "wait_for_checkpoint"]


def __getattr__(name: str) -> Any:
    """``save_load``'s names on first use: it imports torch, and the torch-free modules here
    (``store``, ``deepspeed_layout``) serve the commands' argument checks."""
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.save_load"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
