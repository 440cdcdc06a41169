"""``deepspeed.module_inject.auto_ep_folding``: the rank tables and config rules of AutoEP folded
with AutoTP (``dslaunch.runtime.moe.folding``; pure arithmetic, no process group)."""

from dslaunch.runtime.moe.folding import (
    FoldingGroupHandles,
    FoldingGroupTables,
    ParallelFoldingSpec,
    assert_group_matches_spec,
    build_folding_spec,
    expected_folding_group_tables,
    local_folding_ranks,
    validate_folding_global,
)

__all__ = ["FoldingGroupHandles", "FoldingGroupTables", "ParallelFoldingSpec", "assert_group_matches_spec",
           "build_folding_spec", "expected_folding_group_tables", "local_folding_ranks", "validate_folding_global"]
