"""The ds_config ``elasticity`` block: one batch size that stays valid as the world size changes.

DeepSpeed's semantics (``deepspeed.elasticity.compute_elastic_config``), matched result for
result: the global batch is fixed for the whole job and chosen so that as many world sizes as
possible can split it as ``micro_batch * gradient_accumulation_steps * world_size`` with a micro
batch from ``micro_batch_sizes``; a world size that cannot is an error naming the valid ones.
A job that loses a node keeps training at the same global batch (more accumulation steps), so
losing a node never changes the optimisation, only its speed.

- version 0.1: candidates are each micro batch (and their least common multiple) times the
  largest highly composite number that keeps it <= ``max_train_batch_size``; the candidate with
  the most valid world sizes in ``[min_gpus, max_gpus]`` wins, ties going to the larger batch
  (``prefer_larger_batch``) or the smaller one. Then the largest micro batch that divides
  ``batch / world_size``.
- version 0.2: the same search at node granularity (``num_gpus_per_node``); a world size outside
  the valid list gets the largest (or smallest) multiple of ``micro * world_size`` within the max.

Pure Python, torch-free: the controller uses it to check a smaller world size before a restart,
and ``load_config`` uses it to fill the batch triad (``elastic_batch``). DeepSpeed's own entry
points (``deepspeed.elasticity``: ``compute_elastic_config``, ``elasticity_enabled``,
``ensure_immutable_elastic_config``, which schedulers and ms-swift's elastic callback call) answer
from the same search. DeepSpeed 0.19.8 removed elastic training and refuses the block; dslaunch
keeps it (its launcher restarts on fewer hosts at the same global batch).

Limitations: ``model_parallel_size`` must be 1: the search is over data-parallel ranks (a job with
tensor or pipeline parallelism gets its batch for its data-parallel world).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import INT_MAX, boolean, describe, integer, number
from dslaunch.runtime.config.sections import _opt, parse_section

__all__ = ["ElasticityConfig", "ElasticBatch", "elastic_batch", "valid_world_sizes", "VERSIONS",
           "compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config", "ElasticityError",
           "ElasticityConfigError", "ElasticityIncompatibleWorldSize", "ELASTICITY", "ENABLED", "ENABLED_DEFAULT",
           "DEEPSPEED_ELASTICITY_CONFIG", "MINIMUM_DEEPSPEED_VERSION"]

ELASTICITY, ENABLED, ENABLED_DEFAULT = "elasticity", "enabled", False
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"  # the block a scheduler saw, as JSON
MINIMUM_DEEPSPEED_VERSION = (0, 3, 8)  # DeepSpeed's oldest version with elasticity


class ElasticityError(ConfigError):
    """DeepSpeed's ``ElasticityError`` (also a ``ConfigError`` and a ``ValueError``)."""


class ElasticityConfigError(ElasticityError):
    """DeepSpeed's: the ``elasticity`` block is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """DeepSpeed's: the world size cannot split the elastic global batch."""

VERSIONS = (0.1, 0.2)
# The smallest highly composite numbers (more divisors than any smaller number): scaling a base
# batch by one keeps it divisible by many world sizes. 38 of them reach a batch of 720720.
_HCN = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
        10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760,
        277200, 332640, 498960, 554400, 665280, 720720)


def _micro_batches(path: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"must be a non-empty list of micro batch sizes, e.g. [2, 4, 6]; got "
                          f"{describe(value)}", key=path)
    return tuple(integer(1)(f"{path}[{i}]", v) for i, v in enumerate(value))


def _version(path: str, value: Any) -> float:
    v = number()(path, value)
    if v not in VERSIONS:
        raise ConfigError(f"{v:g} is not a known elasticity version; valid: "
                          f"{', '.join(map(str, VERSIONS))}", key=path)
    return v


@dataclass(frozen=True)
class ElasticityConfig:
    """``elasticity``: DeepSpeed's keys and defaults."""

    enabled: bool = _opt(False, boolean, "true or false")
    max_train_batch_size: int = _opt(2000, integer(1), "the largest acceptable global batch")
    micro_batch_sizes: tuple[int, ...] = _opt((2, 4, 6), _micro_batches, "a list of micro batch sizes")
    min_gpus: int = _opt(1, integer(1), "the fewest GPUs (ranks) the job may run on")
    max_gpus: int = _opt(10000, integer(1), "the most GPUs (ranks) the job may run on")
    min_time: int = _opt(0, integer(0), "minutes before a scheduler may rescale (informational)")
    prefer_larger_batch: bool = _opt(True, boolean, "true or false")
    ignore_non_elastic_batch_info: bool = _opt(False, boolean, "true to let the elastic batch "
                                               "override train_batch_size and friends")
    version: float = _opt(0.1, _version, "0.1 or 0.2")
    # The search is over data-parallel ranks; DeepSpeed's version 0.2 also divides nodes by it.
    model_parallel_size: int = _opt(1, integer(1, 1), "1 (dslaunch's elastic batch is over data-parallel ranks only)")
    num_gpus_per_node: int = _opt(1, integer(1, INT_MAX), "GPUs per node (version 0.2)")

    UNIMPLEMENTED = {}  # noqa: RUF012
    # DeepSpeed's defaults above apply only to a disabled block: an enabled one must say both.
    REQUIRED_WHEN_ENABLED = ("max_train_batch_size", "micro_batch_sizes")


@dataclass(frozen=True)
class ElasticBatch:
    """The batch triad for one world size."""

    train_batch_size: int
    micro_batch: int
    gradient_accumulation_steps: int
    valid_world_sizes: tuple[int, ...]


def _candidates(bases: Sequence[int], most: int) -> list[int]:
    """Each base times the largest HCN that keeps it <= ``most``; a base over ``most`` (the micro
    batches' least common multiple can be) is left out, as DeepSpeed does since its fix #8237
    (before it, that base won unscaled: a global batch over the user's own maximum)."""
    return sorted({max(base * h for h in _HCN if base * h <= most) for base in bases if base <= most})


def _valid_for(batch: int, micros: Sequence[int], low: int, high: int) -> list[int]:
    """World sizes in [low, high] that split ``batch`` evenly with some micro batch."""
    valid: set[int] = set()
    for mb in micros:
        if batch % mb:
            continue
        most = batch // mb
        valid.update(w for w in range(1, most + 1) if most % w == 0 and low <= w <= high)
    return sorted(valid)


def _search(micros: Sequence[int], most: int, low: int, high: int, prefer_larger: bool) -> tuple[int, list[int]]:
    """Version 0.1's search: the candidate batch with the most valid world sizes."""
    if any(mb > most for mb in micros):
        raise ConfigError(f"every micro batch size must be <= max_train_batch_size ({most}); got "
                          f"{list(micros)}", key="elasticity.micro_batch_sizes")
    lcm = math.lcm(*micros)
    best, best_valid = min(micros), []
    for batch in _candidates([*micros, lcm], most):
        valid = _valid_for(batch, micros, low, high)
        better = batch > best if prefer_larger else batch < best
        if len(valid) > len(best_valid) or (len(valid) == len(best_valid) and better):
            best, best_valid = batch, valid
    if not best_valid:  # DeepSpeed fails here with a TypeError (it searches None)
        raise ConfigError(f"no world size in [min_gpus, max_gpus] = [{low}, {high}] can split a batch of at "
                          f"most {most} into micro batches {list(micros)}; widen the range or raise "
                          "max_train_batch_size", key="elasticity")
    return best, best_valid


def valid_world_sizes(cfg: ElasticityConfig, world_size: int) -> tuple[int, list[int]]:
    """``(global batch, valid world sizes)`` as DeepSpeed computes them for ``world_size`` ranks.

    Version 0.1 does not depend on ``world_size``; version 0.2 does (see the module docstring).
    """
    micros, prefer = cfg.micro_batch_sizes, cfg.prefer_larger_batch
    if cfg.version == 0.1:
        return _search(micros, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus, prefer)
    per_node = cfg.num_gpus_per_node  # // model_parallel_size, which is 1
    batch, nodes = _search(micros, cfg.max_train_batch_size // per_node,
                           max(1, cfg.min_gpus // per_node), max(1, cfg.max_gpus // per_node), prefer)
    batch, valid = batch * per_node, [n * per_node for n in nodes]
    if world_size in valid:
        return batch, valid
    fits = [mb * world_size * (cfg.max_train_batch_size // (mb * world_size)) for mb in micros]
    return (max(fits) if prefer else min(fits)), [world_size]


def elastic_batch(cfg: ElasticityConfig, world_size: int) -> ElasticBatch:
    """The batch triad DeepSpeed's elasticity gives ``world_size`` ranks.

    Raises:
        ConfigError: the world size is not one of the valid ones (the message lists them), or
            no micro batch size divides the per-rank batch.
    """
    batch, valid = valid_world_sizes(cfg, world_size)
    where = (f"elasticity (max_train_batch_size {cfg.max_train_batch_size}, micro_batch_sizes "
             f"{list(cfg.micro_batch_sizes)}, min_gpus {cfg.min_gpus}, max_gpus {cfg.max_gpus})")
    if world_size not in valid:
        raise ElasticityIncompatibleWorldSize(f"world size {world_size} cannot split the elastic global batch "
                                              f"{batch}: {where} allows world sizes {valid}", key="elasticity")
    # DeepSpeed picks the largest micro batch that divides the per-rank batch (both versions).
    micro = next((mb for mb in sorted(set(cfg.micro_batch_sizes), reverse=True)
                  if batch // world_size % mb == 0), None)
    if batch == 0:  # version 0.2: not even one micro batch per rank fits under the max
        raise ConfigError(f"max_train_batch_size {cfg.max_train_batch_size} is below "
                          f"min(micro_batch_sizes) * world size = {min(cfg.micro_batch_sizes)} * {world_size}",
                          key="elasticity.max_train_batch_size")
    if micro is None:
        raise ConfigError(f"no micro batch size in {list(cfg.micro_batch_sizes)} divides the per-rank "
                          f"batch {batch} // {world_size} = {batch // world_size} under {where}",
                          key="elasticity.micro_batch_sizes")
    return ElasticBatch(batch, micro, batch // (micro * world_size), tuple(valid))


def elasticity_enabled(ds_config: Mapping[str, Any]) -> bool:
    """Whether ``ds_config`` has an enabled ``elasticity`` block (DeepSpeed's)."""
    return bool(ds_config.get(ELASTICITY, {}).get(ENABLED, ENABLED_DEFAULT))


def _parsed(block: Any) -> ElasticityConfig:
    try:
        return parse_section(ElasticityConfig, block, ELASTICITY)
    except ConfigError as err:
        raise ElasticityConfigError(str(err)) from None


def ensure_immutable_elastic_config(runtime_elastic_config_dict: Mapping[str, Any]) -> None:
    """Check the block a scheduler saw (``$DEEPSPEED_ELASTICITY_CONFIG``, JSON) against this run's:
    the batch limit, micro batches and version must agree, as DeepSpeed's. Without the variable
    there is nothing to compare with.

    Raises:
        ElasticityConfigError: they differ (the message names the key and both values), or the
            variable is not a JSON object.
    """
    seen = os.environ.get(DEEPSPEED_ELASTICITY_CONFIG)
    if seen is None:
        return
    try:
        scheduler = json.loads(seen)
    except ValueError:
        raise ElasticityConfigError(f"${DEEPSPEED_ELASTICITY_CONFIG} is not JSON: {seen[:120]!r}") from None
    theirs, ours = _parsed(scheduler), _parsed(runtime_elastic_config_dict)
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(theirs, key) != getattr(ours, key):
            raise ElasticityConfigError(f"elastic config '{key}={getattr(theirs, key)}' seen by the resource scheduler "
                                        f"does not match the one passed to the runtime ({getattr(ours, key)})")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", str(version))[:3])


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple:
    """DeepSpeed's: ``(global batch, valid world sizes)`` for the ``elasticity`` block, plus the
    micro batch for ``world_size`` when it is given (or ``return_microbatch``). Version 0.2 takes
    the world size from ``$WORLD_SIZE`` when ``world_size`` is 0, as DeepSpeed's.

    Raises:
        ElasticityConfigError: no enabled ``elasticity`` block, an invalid one, or a world size
            needed and not known (DeepSpeed divides by zero there).
        ElasticityError: ``target_deepspeed_version`` predates elasticity (0.3.8).
        ElasticityIncompatibleWorldSize: ``world_size`` cannot split the global batch.
    """
    if not isinstance(ds_config, dict):
        raise ValueError(f"Expected ds_config to be a dictionary but received a {type(ds_config).__name__}")
    if not elasticity_enabled(ds_config):
        raise ElasticityConfigError("'elasticity' is missing from the config or not enabled; add "
                                    "\"elasticity\": {\"enabled\": true, ...} for an elastic training job")
    cfg = _parsed(ds_config[ELASTICITY])
    if _version_tuple(target_deepspeed_version) < MINIMUM_DEEPSPEED_VERSION:
        raise ElasticityError(f"elasticity needs DeepSpeed 0.3.8 or later; the target is {target_deepspeed_version}")
    current = world_size
    if not current and cfg.version == 0.2:
        current = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else 0
        if not current:
            raise ElasticityConfigError("elasticity version 0.2 needs the world size: pass world_size or set WORLD_SIZE")
    if not current and return_microbatch:
        raise ElasticityConfigError("return_microbatch needs world_size: the micro batch depends on it")
    try:
        if world_size <= 0 and not return_microbatch:
            return valid_world_sizes(cfg, current)
        b = elastic_batch(cfg, current)
    except ElasticityError:
        raise
    except ConfigError as err:  # the search's own errors, under DeepSpeed's class
        raise ElasticityConfigError(str(err)) from None
    return b.train_batch_size, list(b.valid_world_sizes), b.micro_batch
