"""``deepspeed.moe``: DeepSpeed's Mixture-of-Experts import paths.

dslaunch has no MoE layer yet. The modules import, so a script (or a test suite's shared model
file) that imports them but builds no MoE layer runs; building one fails with one line saying so.
"""
