"""CPU kernels in C: Adam/AdamW, Adagrad, Lion, the fused offloaded step and 1-bit compression,
loaded with ctypes.

- ``optim.c``: the kernels (auto-vectorised loops; a call takes a table of tensors, one OpenMP
  frame over their fixed blocks), and the streaming references the benchmark measures them
  against (``dsl_stream``, ``dsl_stream_read``); ``compress.c``: the 1-bit pack and unpack.
- ``build.py``: builds ``optim.c`` and ``compress.c`` on first use into a cache keyed by source, flags, compiler and
  CPU; without a compiler ``available()`` is false and the dispatch point keeps torch.
- ``ops.py``: one call per list of flat tensors (``adam_many``, ``adagrad_many``, ``lion_many``;
  ``adam``, ``adagrad``, ``lion`` for one), ``grad_sumsq``, ``stream``, and the
  ``"adam"``/``"cpu_adam"``/``"lion"``/``"adagrad"`` dispatch ops.
- ``compress.py``: the ``"onebit_pack"``/``"onebit_unpack"`` dispatch ops (``compress.c``).
- ``torch_steps.py``: the ``"torch.adam(w)"``/``"torch.adagrad"`` dispatch ops (torch's state).
- ``offload.py``: the offloaded steps of Adam, Adagrad and Lion (unscale, overflow check, norm,
  clip, update, 16-bit copy) in two passes over the gradients.
- ``optimizers.py``: DeepSpeed's ``DeepSpeedCPUAdam``/``Adagrad``/``Lion``
  classes (re-exported by ``dslaunch.ops``).
"""
