"""The folding record of a checkpoint of AutoEP folded with AutoTP (DeepSpeed 0.19.x's
``folding`` entry: ``deepspeed.checkpoint.autoep_universal.make_folding_metadata`` /
``validate_folding_metadata``; the ``FOLDING_*`` keys are ``runtime/checkpoint/deepspeed_constants.py``'s).

A record says where a saved piece sat: the tensor, expert and expert-tensor sizes and this rank's
index in each, the group its ZeRO state was partitioned over (``dense_dp`` for dense parameters,
``edp`` for routed experts) with its index and size there, the parameter family, the dispatch and
where shared experts live. A reader checks the sizes always and any other field it names; a
mismatch is one line naming the field and both values. dslaunch writes the run's record in a tag's
manifest (``autoep_folded.folding_metadata``) and loads a folded tag only at the same record.
"""

from __future__ import annotations

from typing import Any

from dslaunch.runtime.checkpoint.deepspeed_constants import (
    FOLDING_DISPATCH_STRATEGY,
    FOLDING_EP_RANK,
    FOLDING_EP_SIZE,
    FOLDING_ETP_RANK,
    FOLDING_ETP_SIZE,
    FOLDING_FAMILY,
    FOLDING_METADATA_KEY,
    FOLDING_METADATA_VERSION,
    FOLDING_PARAM_FAMILIES,
    FOLDING_SHARED_EXPERT_PLACEMENT,
    FOLDING_TP_RANK,
    FOLDING_TP_SIZE,
    FOLDING_ZERO_PARTITION_COUNT,
    FOLDING_ZERO_PARTITION_GROUP,
    FOLDING_ZERO_PARTITION_RANK,
)

__all__ = ["ROUTE_FULL_PARTITION_DISPATCH", "make_folding_metadata", "validate_folding_metadata"]

ROUTE_FULL_PARTITION_DISPATCH = "route_full_partition_dispatch"
"""DeepSpeed's name of the folded dispatch: every slice routes all tokens, each dispatches its share
(``autoep_folded.py``)."""


def make_folding_metadata(*, tp_size: int, tp_rank: int, ep_size: int, ep_rank: int, zero_partition_group: str,
                          zero_partition_rank: int, zero_partition_count: int, family: str,
                          param_families: dict[str, Any] | None = None) -> dict[str, Any]:
    """One saved piece's record (experts whole on each rank: expert-tensor size 1, index 0; shared
    experts split over the tensor slices as AutoTP splits any MLP)."""
    record: dict[str, Any] = {
        "version": FOLDING_METADATA_VERSION, FOLDING_TP_SIZE: tp_size, FOLDING_TP_RANK: tp_rank,
        FOLDING_EP_SIZE: ep_size, FOLDING_EP_RANK: ep_rank, FOLDING_ETP_SIZE: 1, FOLDING_ETP_RANK: 0,
        FOLDING_ZERO_PARTITION_GROUP: zero_partition_group, FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
        FOLDING_ZERO_PARTITION_COUNT: zero_partition_count, FOLDING_DISPATCH_STRATEGY: ROUTE_FULL_PARTITION_DISPATCH,
        FOLDING_SHARED_EXPERT_PLACEMENT: "tp_sharded", FOLDING_FAMILY: family}
    if param_families is not None:
        record[FOLDING_PARAM_FAMILIES] = dict(param_families)
    return record


def validate_folding_metadata(metadata: Any, *, tp_size: int, ep_size: int, etp_size: int = 1,
                              tp_rank: int | None = None, ep_rank: int | None = None, etp_rank: int | None = None,
                              zero_partition_group: str | None = None, zero_partition_rank: int | None = None,
                              zero_partition_count: int | None = None, family: str | None = None,
                              param_families: dict[str, Any] | None = None,
                              shared_expert_placement: str | None = None,
                              dispatch_strategy: str | None = None) -> dict[str, Any]:
    """The ``folding`` record of ``metadata`` (a saved state dict), checked against the reader: the
    three sizes always, each other field where given (not None).

    Raises:
        RuntimeError: no record, another version, or the first field that differs (named, with the
            saved and the reader's value), as DeepSpeed's.
    """
    if not isinstance(metadata, dict) or FOLDING_METADATA_KEY not in metadata:
        raise RuntimeError("Missing AutoEP+AutoTP folding metadata in folded checkpoint.")
    record = metadata[FOLDING_METADATA_KEY]
    if not isinstance(record, dict) or record.get("version") != FOLDING_METADATA_VERSION:
        version = record.get("version") if isinstance(record, dict) else record
        raise RuntimeError(f"Unsupported folding metadata version: {version} (this reader knows "
                           f"{FOLDING_METADATA_VERSION})")
    wanted = {FOLDING_TP_SIZE: tp_size, FOLDING_EP_SIZE: ep_size, FOLDING_ETP_SIZE: etp_size}
    optional = {FOLDING_TP_RANK: tp_rank, FOLDING_EP_RANK: ep_rank, FOLDING_ETP_RANK: etp_rank,
                FOLDING_ZERO_PARTITION_GROUP: zero_partition_group, FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
                FOLDING_ZERO_PARTITION_COUNT: zero_partition_count, FOLDING_FAMILY: family,
                FOLDING_PARAM_FAMILIES: param_families, FOLDING_SHARED_EXPERT_PLACEMENT: shared_expert_placement,
                FOLDING_DISPATCH_STRATEGY: dispatch_strategy}
    wanted.update((key, value) for key, value in optional.items() if value is not None)
    for key, value in wanted.items():
        if record.get(key) != value:
            raise RuntimeError(f"Folding metadata mismatch for {key}: saved={record.get(key)} runtime={value}")
    return record
