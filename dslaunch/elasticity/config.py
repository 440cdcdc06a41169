"""DeepSpeed's ``deepspeed.elasticity.config``: the block's dataclass and the error classes
(``ElasticityError`` and its two kinds), from ``dslaunch.runtime.config.elasticity``."""

from dslaunch.runtime.config.elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)

__all__ = ["ElasticityConfig", "ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize"]
