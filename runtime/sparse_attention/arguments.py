"""The argument checks of the sparsity layouts, torch-free: ``layouts.py`` runs them when a
layout class is built, the ds_config ``sparse_attention`` section (``config.py``) when the config
is parsed. Each raises ``SparsityConfigError`` in one line naming the argument."""

from __future__ import annotations

from collections.abc import Sequence

from dslaunch.errors import SparsityConfigError

__all__ = ["ATTENTION_TYPES", "check_attention", "check_global_ranges", "check_fixed", "check_windows"]

ATTENTION_TYPES = ("unidirectional", "bidirectional")


def check_attention(attention: str, horizontal_global_attention: bool = False) -> None:
    """``attention`` is uni- or bidirectional; horizontal global attention only with bidirectional.

    Raises:
        SparsityConfigError: otherwise.
    """
    if attention not in ATTENTION_TYPES:
        raise SparsityConfigError(f"attention={attention!r}: must be 'unidirectional' or 'bidirectional'")
    if horizontal_global_attention and attention != "bidirectional":
        raise SparsityConfigError("horizontal_global_attention=True needs attention='bidirectional' (a "
                                  "unidirectional block cannot attend to later blocks)")


def check_global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    """One end per start, each above its start.

    Raises:
        SparsityConfigError: otherwise.
    """
    if ends is None:
        return
    if len(starts) != len(ends):
        raise SparsityConfigError(f"global_block_end_indices has {len(ends)} entries but global_block_indices "
                                  f"has {len(starts)}; give one end per start")
    for start, end in zip(starts, ends, strict=False):
        if start >= end:
            raise SparsityConfigError(f"global block range [{start}, {end}): the start must be below the end")


def check_fixed(num_local_blocks: int, num_global_blocks: int, different_layout_per_head: bool,
                num_different_global_patterns: int) -> None:
    """The fixed pattern's window arithmetic (DeepSpeed's checks).

    Raises:
        SparsityConfigError: otherwise.
    """
    if num_local_blocks % num_global_blocks != 0:
        raise SparsityConfigError(f"num_local_blocks={num_local_blocks} is not a multiple of "
                                  f"num_global_blocks={num_global_blocks}")
    if num_different_global_patterns > 1 and not different_layout_per_head:
        raise SparsityConfigError("num_different_global_patterns > 1 needs different_layout_per_head=True "
                                  "(one layout for all heads has one global pattern)")
    if num_different_global_patterns > num_local_blocks // num_global_blocks:
        raise SparsityConfigError(f"num_different_global_patterns={num_different_global_patterns} is more than "
                                  f"num_local_blocks // num_global_blocks = {num_local_blocks // num_global_blocks}")


def check_windows(local_window_blocks: Sequence[int]) -> None:
    """At least one local window size (the last one repeats to the end).

    Raises:
        SparsityConfigError: otherwise.
    """
    if not local_window_blocks:
        raise SparsityConfigError("local_window_blocks is empty; give at least one window size, e.g. [4]")
