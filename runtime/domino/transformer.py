"""``deepspeed.runtime.domino.transformer``: Domino's transformer, refused on use."""

from dslaunch.utils.refused import Refusal, refused_class

DominoTransformer = refused_class(__name__, "DominoTransformer", Refusal(
    "Domino (tensor-parallel transformer with overlapped communication)",
    "train with ZeRO or deepspeed.pipe; dslaunch has no tensor-parallel training"))

__all__ = ["DominoTransformer"]
