"""Block-sparse attention layouts: which ``block x block`` tiles of the attention matrix are kept.

DeepSpeed's ``deepspeed.ops.sparse_attention.sparsity_config`` classes with their constructor
arguments, defaults and layouts (the same int64 ``[num_heads, num_blocks, num_blocks]`` tensor,
element for element, including the random blocks drawn with Python's ``random`` module in the
same order: ``random.seed(s)`` gives DeepSpeed's layout). A layout row ``i`` of head ``h`` lists
the key blocks that query block ``i`` attends to.

Each class builds its layout in ``make_layout(seq_len)``; a custom pattern subclasses
``SparsityConfig`` and does the same with ``setup_layout`` and
``check_and_propagate_first_head_layout``. Bad arguments raise ``SparsityConfigError`` (a
``ValueError`` and a ``NotImplementedError``, what DeepSpeed raises) in one line.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from dslaunch.errors import SparsityConfigError
from dslaunch.runtime.sparse_attention.arguments import (
    check_attention,
    check_fixed,
    check_global_ranges,
    check_windows,
)

__all__ = ["SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
           "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig"]

def _at_most(what: str, count: int, num_blocks: int) -> None:
    if num_blocks < count:
        raise SparsityConfigError(f"{what}={count} is more than the {num_blocks} blocks of a row at this "
                                  "sequence length; lower it or use a longer sequence")


class SparsityConfig:
    """The base of every layout: heads, block size, and whether each head has its own layout.

    Args:
        num_heads: attention heads of the layer.
        block: the block (tile) size; sequence lengths must be multiples of it.
        different_layout_per_head: give each head its own layout (else head 0's is copied).
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        if not isinstance(block, int) or block < 1:
            raise SparsityConfigError(f"block={block!r}: must be a positive integer, e.g. 16")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero int64 layout ``[num_heads, seq_len // block, seq_len // block]``.

        Raises:
            SparsityConfigError: ``seq_len`` is not a multiple of the block size.
        """
        if seq_len % self.block != 0:
            raise SparsityConfigError(f"sequence length {seq_len} is not a multiple of the block size "
                                      f"{self.block}; pad it (SparseAttentionUtils.pad_to_block_size)")
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless each head has its own; returns ``layout``."""
        if not self.different_layout_per_head:
            layout[1:self.num_heads] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The layout for ``seq_len``; a subclass defines it.

        Raises:
            SparsityConfigError: always here (DeepSpeed's base class has no layout either).
        """
        raise SparsityConfigError(f"{type(self).__name__} has no layout of its own: use DenseSparsityConfig, "
                                  "FixedSparsityConfig, VariableSparsityConfig, BigBirdSparsityConfig, "
                                  "BSLongformerSparsityConfig or LocalSlidingWindowSparsityConfig")

    def _layout_per_head(self, seq_len: int, *steps: str) -> torch.Tensor:
        """``setup_layout``, then each ``set_*`` method of ``steps`` per layout head, then propagate."""
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            for step in steps:
                layout = getattr(self, step)(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class DenseSparsityConfig(SparsityConfig):
    """Every block kept: dense attention in the block-sparse format (for comparison)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """All ones.

        Raises:
            SparsityConfigError: ``seq_len`` is not a multiple of the block size.
        """
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _local_windows(layout: torch.Tensor, h: int, start: int, end: int, causal: bool) -> None:
    """Blocks ``[start, end)`` attend to each other (causal: only to themselves and earlier ones)."""
    for row in range(start, end):
        layout[h, row, start:(row + 1 if causal else end)] = 1


class FixedSparsityConfig(SparsityConfig):
    """The "fixed" pattern of Sparse Transformers (arXiv:1904.10509), as DeepSpeed customises it:
    local windows of ``num_local_blocks`` blocks, and the last ``num_global_blocks`` blocks of each
    window attended by all (heads may pick other blocks of the window with
    ``num_different_global_patterns``).

    Args:
        num_heads, block, different_layout_per_head: as ``SparsityConfig``.
        num_local_blocks: blocks per local window.
        num_global_blocks: blocks of each window that are global; divides ``num_local_blocks``.
        attention: ``'bidirectional'`` or ``'unidirectional'`` (causal).
        horizontal_global_attention: global blocks also attend to every block (bidirectional only).
        num_different_global_patterns: how many different global block choices the heads cycle
            through (needs ``different_layout_per_head``).

    Raises:
        SparsityConfigError: an invalid combination (DeepSpeed's checks).
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1):
        super().__init__(num_heads, block, different_layout_per_head)
        check_fixed(num_local_blocks, num_global_blocks, different_layout_per_head, num_different_global_patterns)
        check_attention(attention, horizontal_global_attention)
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s local windows set in ``layout``; returns it."""
        num_blocks = layout.shape[1]
        for start in range(0, num_blocks, self.num_local_blocks):
            _local_windows(layout, h, start, min(start + self.num_local_blocks, num_blocks),
                           self.attention == "unidirectional")
        return layout

    def _set_global(self, h: int, layout: torch.Tensor, first: int) -> None:
        last = first + self.num_global_blocks
        layout[h, 0 if self.attention == "bidirectional" else first:, first:last] = 1
        if self.horizontal_global_attention:
            layout[h, first:last, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s global blocks set in ``layout`` (a short last window still gets its own,
        as far back as fits); returns it."""
        num_blocks = layout.shape[1]
        offset = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        full = num_blocks - num_blocks % self.num_local_blocks
        for first in range(offset, full, self.num_local_blocks):
            self._set_global(h, layout, first)
        if full < num_blocks:
            self._set_global(h, layout, min(full + offset, num_blocks - self.num_global_blocks))
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The fixed layout for ``seq_len``.

        Raises:
            SparsityConfigError: ``seq_len`` is not a multiple of the block size.
        """
        return self._layout_per_head(seq_len, "set_local_layout", "set_global_layout")


def _random_rows(layout: torch.Tensor, h: int, count: int, causal: bool) -> None:
    """``count`` random key blocks per row (causal: among the row's own and earlier blocks)."""
    num_blocks = layout.shape[1]
    _at_most("num_random_blocks", count, num_blocks)
    for row in range(num_blocks):
        population = range(row + 1) if causal else range(num_blocks)
        if count > len(population):
            raise SparsityConfigError(f"num_random_blocks={count} is more than the {len(population)} earlier "
                                      f"blocks of row {row} under unidirectional attention; lower it")
        layout[h, row, random.sample(population, count)] = 1


def _global_ranges(starts: Sequence[int], ends: Sequence[int] | None, num_blocks: int) -> list[tuple[int, int]]:
    """The global block ranges that start inside the sequence, cut at its end."""
    if ends is None:
        return [(i, i + 1) for i in starts if i < num_blocks]
    return [(s, min(e, num_blocks)) for s, e in zip(starts, ends, strict=False) if s < num_blocks]


class VariableSparsityConfig(SparsityConfig):
    """DeepSpeed's "variable" pattern: random blocks, local windows of the given sizes (the last
    size repeated to the end), and global blocks at the given indices or ranges.

    Args:
        num_heads, block, different_layout_per_head: as ``SparsityConfig``.
        num_random_blocks: random key blocks per row.
        local_window_blocks: sizes of the successive local windows; the last one repeats.
        global_block_indices: global blocks (or the starts of global ranges).
        global_block_end_indices: the ends (exclusive) of the global ranges, or None.
        attention: ``'bidirectional'`` or ``'unidirectional'``.
        horizontal_global_attention: global blocks also attend to every block.

    Raises:
        SparsityConfigError: an invalid combination (DeepSpeed's checks).
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: Sequence[int] = (4,),
                 global_block_indices: Sequence[int] = (0,), global_block_end_indices: Sequence[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False):
        super().__init__(num_heads, block, different_layout_per_head)
        check_windows(local_window_blocks)
        check_global_ranges(global_block_indices, global_block_end_indices)
        check_attention(attention, horizontal_global_attention)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s random blocks (drawn from every block, whatever the attention); returns ``layout``."""
        _random_rows(layout, h, self.num_random_blocks, causal=False)
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s local windows; returns ``layout``."""
        num_blocks = layout.shape[1]
        causal = self.attention == "unidirectional"
        start = 0
        for size in self.local_window_blocks:
            _local_windows(layout, h, start, min(start + size, num_blocks), causal)
            start += size
        last = self.local_window_blocks[-1]
        for begin in range(start, num_blocks, last):
            _local_windows(layout, h, begin, min(begin + last, num_blocks), causal)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s global columns (and rows if horizontal); returns ``layout``."""
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, layout.shape[1]):
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            layout[h, 0 if self.attention == "bidirectional" else start:, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The variable layout for ``seq_len`` (random blocks from Python's ``random``).

        Raises:
            SparsityConfigError: ``seq_len`` is not a multiple of the block size, or too short.
        """
        return self._layout_per_head(seq_len, "set_random_layout", "set_local_layout", "set_global_layout")


def _sliding_window(layout: torch.Tensor, h: int, window: int, causal: bool) -> None:
    """Each row attends to the ``window // 2`` blocks on each side (causal: only before)."""
    num_blocks = layout.shape[1]
    _at_most("num_sliding_window_blocks", window, num_blocks)
    half = window // 2
    for row in range(num_blocks):
        layout[h, row, max(0, row - half):(row + 1 if causal else min(row + half + 1, num_blocks))] = 1


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (arXiv:2007.14062): random blocks, a sliding window, and the first
    ``num_global_blocks`` blocks global both ways.

    Args:
        num_heads, block, different_layout_per_head: as ``SparsityConfig``.
        num_random_blocks: random key blocks per row.
        num_sliding_window_blocks: width of the sliding window, in blocks.
        num_global_blocks: how many leading blocks are global.
        attention: ``'bidirectional'`` or ``'unidirectional'`` (then everything above the
            diagonal is dropped).

    Raises:
        SparsityConfigError: an invalid attention type.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s random blocks (causal: among earlier ones); returns ``layout``."""
        _random_rows(layout, h, self.num_random_blocks, causal=self.attention == "unidirectional")
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s sliding window (both sides, whatever the attention); returns ``layout``."""
        _sliding_window(layout, h, self.num_sliding_window_blocks, causal=False)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s leading global blocks (rows and columns); unidirectional then drops every
        block above the diagonal, of all heads. Returns the layout."""
        _at_most("num_global_blocks", self.num_global_blocks, layout.shape[1])
        layout[h, :self.num_global_blocks, :] = 1
        layout[h, :, :self.num_global_blocks] = 1
        return torch.tril(layout) if self.attention == "unidirectional" else layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The BigBird layout for ``seq_len`` (random blocks from Python's ``random``).

        Raises:
            SparsityConfigError: ``seq_len`` is not a multiple of the block size, or too short.
        """
        return self._layout_per_head(seq_len, "set_random_layout", "set_sliding_window_layout",
                                     "set_global_layout_itc")


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (arXiv:2004.05150): a sliding window and global blocks (given
    indices or ranges) that attend and are attended both ways.

    Args:
        num_heads, block, different_layout_per_head: as ``SparsityConfig``.
        num_sliding_window_blocks: width of the sliding window, in blocks.
        global_block_indices: global blocks (or the starts of global ranges).
        global_block_end_indices: the ends (exclusive) of the global ranges, or None.
        attention: ``'bidirectional'``, or ``'unidirectional'`` (then everything above the
            diagonal is dropped).

    Raises:
        SparsityConfigError: inconsistent global ranges.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: Sequence[int] = (0,),
                 global_block_end_indices: Sequence[int] | None = None, attention: str = "bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        check_global_ranges(global_block_indices, global_block_end_indices)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s sliding window (both sides); returns ``layout``."""
        _sliding_window(layout, h, self.num_sliding_window_blocks, causal=False)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s global rows and columns; unidirectional then drops every block above the
        diagonal. Returns the layout."""
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, layout.shape[1]):
            layout[h, start:end, :] = 1
            layout[h, :, start:end] = 1
        return torch.tril(layout) if self.attention == "unidirectional" else layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The block-sparse Longformer layout for ``seq_len``.

        Raises:
            SparsityConfigError: ``seq_len`` is not a multiple of the block size, or too short.
        """
        return self._layout_per_head(seq_len, "set_sliding_window_layout", "set_global_layout")


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window only: each block attends to ``num_sliding_window_blocks // 2`` blocks on
    each side (unidirectional, the default: only the earlier ones and itself).

    Args:
        num_heads, block: as ``SparsityConfig`` (one layout for all heads).
        num_sliding_window_blocks: width of the window, in blocks.
        attention: ``'unidirectional'`` (default) or ``'bidirectional'``.
    """

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Head ``h``'s window; returns ``layout``."""
        _sliding_window(layout, h, self.num_sliding_window_blocks, causal=self.attention != "bidirectional")
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The sliding-window layout for ``seq_len``.

        Raises:
            SparsityConfigError: ``seq_len`` is not a multiple of the block size, or too short.
        """
        return self._layout_per_head(seq_len, "set_sliding_window_layout")
