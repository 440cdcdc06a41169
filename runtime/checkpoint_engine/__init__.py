"""DeepSpeed's ``deepspeed.runtime.checkpoint_engine``: its checkpoint-engine interface for code that
saves and loads its own files through it (``TorchCheckpointEngine().save(state, path)``).

- ``checkpoint_engine.py``: ``CheckpointEngine`` (the abstract interface) and ``CheckpointCommitInfo``.
- ``torch_checkpoint_engine.py``: ``TorchCheckpointEngine``, torch.save/torch.load, each file written
  whole or not at all (``dslaunch.safe_write``).

The engine's own checkpoints do not go through a checkpoint engine (``runtime/checkpoint``:
manifests, atomic tags); DeepSpeed's fast, decoupled and DataStates engines (its ``checkpoint.writer``
and ``datastates_ckpt`` config) are refused where they are named.
"""

from dslaunch.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from dslaunch.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

__all__ = ["CheckpointEngine", "CheckpointCommitInfo", "TorchCheckpointEngine"]
