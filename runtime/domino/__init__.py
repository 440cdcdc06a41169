"""``deepspeed.runtime.domino``: Domino, tensor-parallel training with its all-reduces hidden
behind the other micro batch's compute (``transformer.py``, ``async_linear.py``).
"""
