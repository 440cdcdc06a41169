"""``deepspeed.runtime.data_pipeline.data_routing``: random-LTD (random layer-wise token dropping).

``basic_layer.py`` (``RandomLayerTokenDrop``), ``scheduler.py`` (the kept length per step),
``tokens.py`` (drawing, gathering and scattering tokens in torch), ``helper.py``
(``convert_to_random_ltd``, saving without the wrappers), ``utils.py`` (DeepSpeed's per-sample
helpers) and ``wiring.py`` (what the engine does with them).
"""
