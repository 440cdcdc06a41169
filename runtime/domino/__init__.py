"""``deepspeed.runtime.domino``: Domino (tensor-parallel compute/communication overlap), refused on
use (``transformer.py``).
"""
