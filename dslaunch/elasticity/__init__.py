"""DeepSpeed's ``deepspeed.elasticity``: the elastic global batch for a world size
(``compute_elastic_config``), the checks around it, and its errors (also in ``config.py``, where
DeepSpeed defines them); from ``dslaunch.runtime.config.elasticity``. DeepSpeed 0.19.8 removed the package and the config block;
dslaunch keeps both (its launcher restarts on fewer hosts at the same global batch:
``--elastic_training``). DeepSpeed's torch-elastic agent is refused: dslaunch's launcher is the agent.
"""

from dslaunch.runtime.config.elasticity import (
    DEEPSPEED_ELASTICITY_CONFIG,
    ELASTICITY,
    ENABLED,
    ENABLED_DEFAULT,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    elasticity_enabled,
    ensure_immutable_elastic_config,
)
from dslaunch.utils.lazy import submodule_getattr
from dslaunch.utils.refused import Refusal, refused_class

__getattr__ = submodule_getattr(__name__)  # deepspeed.elasticity.config after a bare import

__all__ = ["compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config", "ElasticityError",
           "ElasticityConfigError", "ElasticityIncompatibleWorldSize", "ELASTICITY", "ENABLED", "ENABLED_DEFAULT",
           "DEEPSPEED_ELASTICITY_CONFIG", "DSElasticAgent", "is_torch_elastic_compatible"]

DSElasticAgent = refused_class(__name__, "DSElasticAgent", Refusal(
    "DeepSpeed's torch-elastic agent", "run with `dslaunch --elastic_training` (or `deepspeed --elastic_training`)"))


def is_torch_elastic_compatible() -> bool:
    """DeepSpeed's probe for its torch-elastic agent: False, since that agent is refused here
    (scripts that check it before importing ``DSElasticAgent`` take their other path)."""
    return False
