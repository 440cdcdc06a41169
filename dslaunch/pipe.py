"""``deepspeed.pipe`` under dslaunch's name: ``from dslaunch.pipe import PipelineModule, LayerSpec``.

``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` are defined in
``dslaunch.runtime.pipe.module`` (DeepSpeed's ``deepspeed.runtime.pipe.module``); the topology
classes DeepSpeed also re-exports here come from ``dslaunch.runtime.pipe.topology``;
``DualPipeVModule`` (DeepSpeed 0.19.8) comes from ``dslaunch.runtime.pipe.dualpipev``. Importing this
module imports torch.
"""

from dslaunch.runtime.pipe.dualpipev import DualPipeVModule
from dslaunch.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from dslaunch.runtime.pipe.topology import (
           PipeDataParallelTopology,
           PipeModelDataParallelTopology,
           ProcessTopology,
)

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "DualPipeVModule"]
