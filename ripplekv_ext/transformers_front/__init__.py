"""What a transformers user calls: ``compress`` (``compress_block``: compression of a model's cache inside a ``with``
block, during prefill and decoding), bounded prefill (``bounded_prefill``: a prompt read in chunks under its budget),
compressed contexts (``context``: compress once, ask many; ``context_stamp``: what a saved context carries and how it
is checked), masks after compression (``masks``) and digests of weights and caches (``digests``).

Nothing here imports transformers at a module's top, so ``import ripplekv_ext`` stays light: each function that
needs it imports ``ripplekv_ext.integrations.transformers`` (the one module that touches transformers' internals)
when it is called.
"""
