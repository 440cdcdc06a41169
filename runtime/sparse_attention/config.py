"""The ds_config ``sparse_attention`` section: the layout a model's sparse attention uses.

DeepSpeed 0.19.7 and older parse it into ``DeepSpeedConfig.sparse_attention`` (a dict, None without
the section) for the model code to build its layout from (DeepSpeed's BERT examples do); the
engine itself does nothing with it. dslaunch parses it into ``SparseAttentionConfig`` (keys,
defaults and modes as DeepSpeed's: ``mode`` one of dense, fixed, variable, bigbird, bslongformer)
with each layout's argument checks run at parse time, and builds the layout object with
``sparsity_config(num_heads)``. Keys of other modes are accepted and unused, as in DeepSpeed.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError, SparsityConfigError
from dslaunch.runtime.config.param_schema import boolean, choice, describe, integer
from dslaunch.runtime.config.sections import _opt, optional
from dslaunch.runtime.sparse_attention.arguments import (
    ATTENTION_TYPES,
    check_attention,
    check_fixed,
    check_global_ranges,
    check_windows,
)

__all__ = ["SparseAttentionConfig", "MODES", "MODE_KEYS"]

#: Each mode's keys (besides ``mode``), in DeepSpeed's order: what ``as_dict`` gives.
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": ("block",),
    "fixed": ("block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
              "horizontal_global_attention", "num_different_global_patterns"),
    "variable": ("block", "different_layout_per_head", "num_random_blocks", "local_window_blocks",
                 "global_block_indices", "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": ("block", "different_layout_per_head", "num_random_blocks", "num_sliding_window_blocks",
                "num_global_blocks"),
    "bslongformer": ("block", "different_layout_per_head", "num_sliding_window_blocks", "global_block_indices",
                     "global_block_end_indices"),
}
MODES = tuple(MODE_KEYS)
_CLASSES = {"dense": "DenseSparsityConfig", "fixed": "FixedSparsityConfig", "variable": "VariableSparsityConfig",
            "bigbird": "BigBirdSparsityConfig", "bslongformer": "BSLongformerSparsityConfig"}


def _indices(low: int) -> Any:
    item = integer(low)

    def check(path: str, value: Any) -> tuple[int, ...]:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"must be a list of integers, got {describe(value)}", key=path)
        return tuple(item(f"{path}[{i}]", v) for i, v in enumerate(value))

    return check


@dataclass(frozen=True)
class SparseAttentionConfig:
    """``sparse_attention``: the block-sparse layout (``mode``) and its parameters."""

    mode: str = _opt("fixed", choice(*MODES), "one of " + ", ".join(MODES))
    block: int = _opt(16, integer(1), "the block size, e.g. 16")
    different_layout_per_head: bool = _opt(False, boolean, "true or false")
    num_local_blocks: int = _opt(4, integer(1), "blocks per local window (fixed), e.g. 4")
    num_global_blocks: int = _opt(1, integer(1), "global blocks (fixed: per window; bigbird: leading), e.g. 1")
    attention: str = _opt("bidirectional", choice(*ATTENTION_TYPES), "unidirectional or bidirectional")
    horizontal_global_attention: bool = _opt(False, boolean, "true or false")
    num_different_global_patterns: int = _opt(1, integer(1), "an integer >= 1")
    num_random_blocks: int = _opt(0, integer(0), "random blocks per row (variable, bigbird), e.g. 1")
    local_window_blocks: tuple[int, ...] = _opt((4,), _indices(1), "a list of window sizes, e.g. [4]")
    global_block_indices: tuple[int, ...] = _opt((0,), _indices(0), "a list of block indices, e.g. [0]")
    global_block_end_indices: tuple[int, ...] | None = _opt(None, optional(_indices(1)),
                                                             "null or a list of block indices (exclusive ends)")
    num_sliding_window_blocks: int = _opt(3, integer(1), "the sliding window in blocks, e.g. 3")

    UNIMPLEMENTED = {}  # noqa: RUF012

    def __post_init__(self) -> None:
        try:
            if self.mode == "fixed":
                check_fixed(self.num_local_blocks, self.num_global_blocks, self.different_layout_per_head,
                            self.num_different_global_patterns)
            if self.mode in ("fixed", "variable"):
                check_attention(self.attention, self.horizontal_global_attention)
            if self.mode == "variable":
                check_windows(self.local_window_blocks)
            if self.mode in ("variable", "bslongformer"):
                check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        except SparsityConfigError as e:
            raise ConfigError(f"{e} (mode {self.mode!r})", key="sparse_attention") from None

    def as_dict(self) -> dict[str, Any]:
        """DeepSpeed's ``DeepSpeedConfig.sparse_attention`` dict: ``mode`` and that mode's keys."""
        out: dict[str, Any] = {"mode": self.mode}
        for key in MODE_KEYS[self.mode]:
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def sparsity_config(self, num_heads: int) -> Any:
        """The layout object of this section for a layer of ``num_heads`` heads (imports torch).

        Args:
            num_heads: the attention heads of the layer.

        Returns:
            A ``SparsityConfig`` subclass instance (``DenseSparsityConfig`` ... per ``mode``).
        """
        from dslaunch.runtime.sparse_attention import layouts

        cls = getattr(layouts, _CLASSES[self.mode])
        kwargs = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.as_dict().items() if k != "mode"}
        if self.mode in ("bigbird", "bslongformer"):  # the classes take it; DeepSpeed's section leaves it out
            kwargs["attention"] = self.attention
        return cls(num_heads=num_heads, **kwargs)
