"""DeepSpeed's ``deepspeed.runtime.pipe.dualpipev``: DualPipeV (DeepSeek-V3's V-shaped pipeline, each
rank holding the stages ``r`` and ``2 * stages - 1 - r``), refused on use in one line.

DeepSpeed 0.19.8 added it (``deepspeed.pipe.DualPipeVModule``); a script importing the name loads,
and building the module, the engine or the schedule says what to use instead: dslaunch's 1F1B
pipeline, or its interleaved schedule, which also gives each rank two parts of the model
(``PipelineModule(virtual_stages=2)``), placed round-robin instead of in a V.
"""

from dslaunch.runtime.pipe.schedule import DUALPIPEV
from dslaunch.utils.refused import refused_class

DualPipeVModule = refused_class(__name__, "DualPipeVModule", DUALPIPEV)
DualPipeVEngine = refused_class(__name__, "DualPipeVEngine", DUALPIPEV)

__all__ = ["DualPipeVModule", "DualPipeVEngine"]
