"""DeepSpeed's ``TorchCheckpointEngine``: ``torch.save`` and ``torch.load``, a saved file whole or
not at all (written beside the path and renamed onto it, ``safe_write.atomic_path``)."""

from __future__ import annotations

from typing import Any

import torch

from dslaunch import safe_write
from dslaunch.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

__all__ = ["TorchCheckpointEngine"]


class TorchCheckpointEngine(CheckpointEngine):
    """``save(state_dict, path)`` / ``load(path, map_location)``, as DeepSpeed's (its load reads
    with ``weights_only=False``: open only files you trust)."""

    def __init__(self, config_params: Any = None):
        super().__init__(config_params)
        self.name = "TorchCheckpointEngine"

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        with safe_write.atomic_path(path) as tmp:
            torch.save(state_dict, tmp)

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True
