"""``deepspeed.runtime.data_pipeline.data_routing``: random-LTD, refused on use (``helper.py``).
"""
