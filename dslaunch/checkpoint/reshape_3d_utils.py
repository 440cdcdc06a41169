"""``deepspeed.checkpoint.reshape_3d_utils``: the (pipeline, tensor, data) shape of a tag and its
reshaping (``dslaunch.runtime.checkpoint.deepspeed_reshape``)."""

from dslaunch.runtime.checkpoint.deepspeed_reshape import (
    DP_DIM,
    PP_DIM,
    TP_DIM,
    flatten_dp_dimension,
    get_model_3d_descriptor,
    model_3d_desc,
    unflatten_dp_dimension,
)
from dslaunch.runtime.checkpoint.deepspeed_reshape import (
    model_3d_descriptor_from_metadata as get_model_3d_descriptor_from_metadata,
)

__all__ = ["DP_DIM", "PP_DIM", "TP_DIM", "flatten_dp_dimension", "get_model_3d_descriptor",
           "get_model_3d_descriptor_from_metadata", "model_3d_desc", "unflatten_dp_dimension"]
