"""``deepspeed.module_inject.auto_ep_folding``: the rank tables and config rules of AutoEP folded
with AutoTP (``dslaunch.runtime.moe.folding``; pure arithmetic, no process group)."""

from dslaunch.runtime.moe import folding

# bound below from runtime.moe.folding (the same objects), hence F822
__all__ = ["FoldingGroupHandles", "FoldingGroupTables", "ParallelFoldingSpec",  # noqa: F822
           "assert_group_matches_spec", "build_folding_spec", "expected_folding_group_tables",  # noqa: F822
           "local_folding_ranks", "validate_folding_global"]  # noqa: F822

globals().update({name: getattr(folding, name) for name in __all__})
