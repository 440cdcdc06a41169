"""DeepSpeed 0.19.8's ZeRO-3 AutoEP layout (``checkpoint_format: "zero3_partitioned"``), both ways.

At ZeRO stage 3 DeepSpeed writes no per-expert files for an AutoEP block: each block's ``w1``,
``w2``, ``w3`` (this expert rank's rows, ``[num_local, ...]``) live only in the ZeRO-3 optimizer
shards, in a param group of their own (``name: ep_size_<ep>``, ``moe: True``) cut over the
expert-data group rather than over every rank. Every rank writes its
``zero_pp_rank_R_mp_rank_00_model_states.pt``, whose ``ds_autoep_layers`` are that rank's (its
``ep_rank``, ``expert_data_parallel_rank``, global expert range) with ``checkpoint_format:
"zero3_partitioned"`` and ``checkpoint_format_version: 1``; its ``param_shapes`` give the expert
weights' local shapes. Each optimizer file adds ``ds_zero_partition_groups``: per ZeRO-3 sub-group
its ``partition_count``, ``partition_rank``, ``partition_ranks`` (global ranks), ``families``
(``replicated`` or ``autoep_expert``) and ``group_names`` (``replicated`` or ``ep_size_<ep>``).
DeepSpeed's load compares that list with its own and refuses another placement, so it is written
exactly as DeepSpeed computes it.

This module owns those records: ``partition_groups`` (written), ``expert_units`` (read: which
saved ranks hold which expert rank's share of a sub-group), ``FORMAT``/``VERSION``.
"""

from __future__ import annotations

from typing import Any

from dslaunch.errors import CheckpointLayoutError

__all__ = ["FORMAT", "VERSION", "PARTITION_GROUPS_KEY", "partition_groups", "expert_units"]

FORMAT = "zero3_partitioned"
"""``ds_autoep_layers[i]["checkpoint_format"]`` of a ZeRO-3 AutoEP tag."""
VERSION = 1
"""``checkpoint_format_version`` DeepSpeed 0.19.8 writes and reads."""
PARTITION_GROUPS_KEY = "ds_zero_partition_groups"
"""The ZeRO-3 optimizer file's per-sub-group partition record (only when a group holds experts)."""


def partition_groups(units: list[tuple[int, int, list[int], str | None]]) -> list[dict[str, Any]] | None:
    """``ds_zero_partition_groups`` as DeepSpeed's ``_zero3_partition_group_metadata`` builds it,
    one entry per sub-group (``units``: partition count, this rank's index, the global ranks it is
    cut over, and the expert group's name or None for a dense one); None without an expert unit
    (DeepSpeed writes the key only then)."""
    if not any(name for _, _, _, name in units):
        return None
    return [{"sub_group": i, "partition_count": count, "partition_rank": rank, "partition_ranks": list(ranks),
             "families": ["autoep_expert" if name else "replicated"], "group_names": [name or "replicated"]}
            for i, (count, rank, ranks, name) in enumerate(units)]


def expert_units(records: list[Any], world: int, where: str) -> list[list[list[int]] | None]:
    """From every saved rank's ``ds_zero_partition_groups`` (``records[r]``, None when absent):
    per sub-group, None when it is cut over all ``world`` ranks, else the saved ranks of each
    expert rank in expert-rank order (each list in partition order). Expert ranks are told apart
    by their sets of ``partition_ranks`` and ordered by their smallest rank, as DeepSpeed numbers
    expert ranks either way (``use_data_before_expert_parallelism`` or not).

    Raises:
        CheckpointLayoutError: the records disagree between ranks or do not cover them.
    """
    if all(r is None for r in records):
        return []
    if any(not isinstance(r, list) for r in records) or len({len(r) for r in records}) != 1:
        raise CheckpointLayoutError(f"key {PARTITION_GROUPS_KEY!r} is missing or has another length on some of the "
                                    f"{world} ranks' optimizer files", where)
    out: list[list[list[int]] | None] = []
    for unit in range(len(records[0])):
        sets: dict[tuple[int, ...], list[int]] = {}
        for saved, record in enumerate(records):
            entry = record[unit]
            ranks = tuple(int(r) for r in entry.get("partition_ranks", []))
            if saved not in ranks or ranks.index(saved) != int(entry.get("partition_rank", -1)):
                raise CheckpointLayoutError(f"key {PARTITION_GROUPS_KEY!r} sub-group {unit}: rank {saved}'s record "
                                            f"{ranks} does not place it at partition_rank "
                                            f"{entry.get('partition_rank')}", where)
            sets[ranks] = list(ranks)
        if len(sets) == 1 and len(next(iter(sets))) == world:
            out.append(None)
            continue
        if sorted(r for s in sets for r in s) != list(range(world)):
            raise CheckpointLayoutError(f"key {PARTITION_GROUPS_KEY!r} sub-group {unit}: its partitions "
                                        f"{sorted(sets)} do not cover the {world} ranks once", where)
        out.append([sets[k] for k in sorted(sets, key=min)])
    return out
