"""The batch triad: ``train_batch_size = micro batch x gradient_accumulation_steps x world`` completed
from the sizes given (DeepSpeed's rules), or taken from the ``elasticity`` block for a world size."""

from __future__ import annotations

from dslaunch.errors import BatchSizeError, ConfigError
from dslaunch.runtime.config.elasticity import ElasticityConfig, elastic_batch

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

__all__ = ["BATCH_KEYS", "batch_triad", "elastic_triad"]


def elastic_triad(cfg: ElasticityConfig, given: dict[str, int | None], world: int) -> dict[str, int]:
    """The triad from the ``elasticity`` block; as DeepSpeed, batch keys given beside it are an
    error unless ``ignore_non_elastic_batch_info`` says they are to be ignored."""
    clash = [k for k, v in given.items() if v is not None]
    if clash and not cfg.ignore_non_elastic_batch_info:
        raise ConfigError("is set while elasticity is enabled, which picks the batch for each world "
                          "size; remove it, or set elasticity.ignore_non_elastic_batch_info to true",
                          key=clash[0])
    b = elastic_batch(cfg, world)
    return {"train_batch_size": b.train_batch_size, "train_micro_batch_size_per_gpu": b.micro_batch,
            "gradient_accumulation_steps": b.gradient_accumulation_steps}


def batch_triad(b: dict[str, int | None], world: int) -> dict[str, int]:
    """Complete train_batch_size = micro * gas * world from any two (or one) of them.

    Raises ``BatchSizeError``, also an ``AssertionError`` as DeepSpeed's batch checks."""
    tb, mb, gas = (b[k] for k in BATCH_KEYS)
    if tb is None and mb is None:
        raise BatchSizeError("set train_batch_size or train_micro_batch_size_per_gpu (or both)",
                          key="train_batch_size")
    if tb is None:
        gas = gas or 1
        tb = mb * gas * world
    elif mb is None:
        gas = gas or 1
        if tb % (gas * world):
            raise BatchSizeError(f"{tb} is not divisible by gradient_accumulation_steps * world_size = "
                              f"{gas} * {world} = {gas * world}", key="train_batch_size")
        mb = tb // (gas * world)
    elif gas is None:
        if tb % (mb * world):
            raise BatchSizeError(f"{tb} is not divisible by train_micro_batch_size_per_gpu * world_size = "
                              f"{mb} * {world} = {mb * world}", key="train_batch_size")
        gas = tb // (mb * world)
    elif tb != mb * gas * world:
        raise BatchSizeError(f"{tb} != train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
                          f"world_size = {mb} * {gas} * {world} = {mb * gas * world}",
                          key="train_batch_size")
    return {"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb,
            "gradient_accumulation_steps": gas}
