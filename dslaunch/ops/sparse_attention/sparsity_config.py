"""``deepspeed.ops.sparse_attention.sparsity_config``: the sparsity layouts, refused on use."""

from dslaunch.utils.refused import Refusal, refuse

SPARSE_ATTENTION = Refusal("block-sparse attention (deepspeed.ops.sparse_attention)",
                           "use dense attention (torch.nn.functional.scaled_dot_product_attention with attn_mask)")

_REFUSED = ("SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
            "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig")
globals().update(refuse(__name__, _REFUSED, SPARSE_ATTENTION))

__all__ = ["SPARSE_ATTENTION", *_REFUSED]
