"""Everything that depends on how transformers' models are built (their modules, forwards, caches).

Import the submodule you need (``ripplekv_ext.integrations.transformers.layer_forwards``); this package imports
nothing by itself.
"""
