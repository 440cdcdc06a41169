"""DeepSpeed's AutoEP universal-checkpoint helpers (``deepspeed.checkpoint.autoep_universal``):
refused in one line each.

DeepSpeed converts an AutoEP run's ZeRO-1/2 expert states (one fragment file per parameter, state
and data-parallel rank) into a universal checkpoint to load it at another ``autoep_size``. dslaunch
needs no conversion: its tag loads online at another ``autoep_size``, world size or ZeRO stage
(docs/parallelism.md, AutoEP), and it writes no such fragments, so these names only answer a
script that imports them.
"""

from __future__ import annotations

from typing import Any, NoReturn

from dslaunch.errors import NotInDslaunchError

__all__ = ["consolidate_autoep_expert_files", "consolidate_autoep_zero12_expert_states"]

_INSTEAD = ("dslaunch loads an AutoEP tag at another autoep_size directly (engine.load_checkpoint), with no "
            "universal conversion")


def _refuse(name: str, what: str = "expert states") -> NoReturn:
    raise NotInDslaunchError(f"deepspeed.checkpoint.autoep_universal.{name} (DeepSpeed's consolidation of AutoEP "
                             f"{what} for a universal checkpoint) is not in dslaunch; {_INSTEAD}")


def consolidate_autoep_expert_files(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused: DeepSpeed's per-expert files (folded AutoEP+AutoTP expert shards among them) into a
    universal checkpoint; dslaunch writes no such files."""
    _refuse("consolidate_autoep_expert_files", "expert files, folded AutoEP+AutoTP expert shards among them,")


def consolidate_autoep_zero12_expert_states(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused (see the module docstring)."""
    _refuse("consolidate_autoep_zero12_expert_states")


def zero12_fragment_path(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused: the fragment files this would name are DeepSpeed's (``_zero12_fragment_path``)."""
    _refuse("_zero12_fragment_path")
