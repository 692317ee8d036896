"""Integrations with the libraries ripplekv_ext runs inside.

``ripplekv_ext.integrations.transformers`` is the one door to transformers (it imports transformers at its top);
the core reaches it through ``transformers_integration()`` when a block opens, so ``import ripplekv_ext`` loads no
transformers.
"""

import importlib


def transformers_integration():
    """The ``ripplekv_ext.integrations.transformers`` module (importing it imports transformers)."""
    return importlib.import_module("ripplekv_ext.integrations.transformers")
