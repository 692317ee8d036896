"""Integrations with the libraries ripplekv_ext runs inside.

``ripplekv_ext.integrations.transformers`` is the one module that imports transformers (at its top); the core's
functions that need it import it when they are called, with ordinary imports, so ``import ripplekv_ext`` loads no
transformers.
"""
