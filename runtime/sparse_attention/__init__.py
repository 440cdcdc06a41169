"""Block-sparse self-attention: DeepSpeed's ``deepspeed.ops.sparse_attention`` (removed from
DeepSpeed in 0.19.8; its API as of 0.19.7).

Modules: ``layouts.py`` (the ``SparsityConfig`` classes: which tiles are kept), ``arguments.py``
(their argument checks, torch-free), ``attention.py`` (``SparseSelfAttention``,
``BertSparseSelfAttention``), ``utils.py`` (``SparseAttentionUtils``), ``config.py`` (the ds_config
``sparse_attention`` section, torch-free). The block-sparse ops themselves (``MatMul``,
``Softmax``) are kernels: ``dslaunch.kernels.block_sparse``. Importing this package imports
nothing else (the config parser reads ``config.py`` without torch).
"""
