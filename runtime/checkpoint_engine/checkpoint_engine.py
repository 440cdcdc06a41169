"""DeepSpeed's checkpoint-engine interface: ``CheckpointEngine`` and ``CheckpointCommitInfo``."""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any

from dslaunch import safe_write

__all__ = ["CheckpointEngine", "CheckpointCommitInfo"]


@dataclass(frozen=True)
class CheckpointCommitInfo:
    """The tag being saved, where, and whether ``latest`` is to name it."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """DeepSpeed's interface: ``create`` before a tag's files, ``save``/``load`` one file each,
    ``commit`` once they are all written; the rest have DeepSpeed's defaults."""

    def __init__(self, config_params: Any = None):
        self.name: str | None = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> None: ...

    @abc.abstractmethod
    def save(self, state_dict: Any, path: str) -> None: ...

    @abc.abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any: ...

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool: ...

    def makedirs(self, path: str | os.PathLike[str], exist_ok: bool = False) -> None:
        """``os.makedirs``, through ``safe_write`` (no directory made where another user's link leads)."""
        if not exist_ok and os.path.exists(path):
            raise FileExistsError(f"{path}: exists")
        safe_write.make_dirs(path)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:  # noqa: B027 (DeepSpeed's optional hook)
        """Only a decoupled engine keeps it; this one has nothing to record."""

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return None

    def cleanup(self) -> None:  # noqa: B027 (DeepSpeed's optional hook)
        """Nothing held between saves here."""

    def preserves_storage_sharing(self) -> bool:
        return True
