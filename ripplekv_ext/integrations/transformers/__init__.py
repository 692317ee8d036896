"""The one module between ripplekv_ext and transformers: everything that depends on transformers' internals.

The core's functions import what they need from here when they are called, by plain imports (``import
ripplekv_ext`` loads no transformers); importing it imports transformers, and fails with the supported range named
when transformers is missing. What lives here:

* ``versions``: the supported torch / transformers ranges and the adapters for the differences within them;
* ``CompressedLayer`` (``compressed_layer``): a full-attention cache layer after compression, an ordinary
  ``CacheLayer`` subclass;
* ``attention``: the attention registration (a uniquely named ``AttentionInterface`` entry per block, the model's
  configs switched to it; the global entries are never replaced) and the eager attention function;
* ``cache_steps``: the steps on a model's cache -- ``compress_layer`` at the end of a prefill,
  ``reselect_layer`` during decoding, ``compressed_cache`` (a cache rebuilt from captured prefill steps),
  ``probe_cache`` / ``drop_probe`` (a prefill whose last tokens are dropped afterwards) and the
  lookups the core needs (``layer_at``, ``cache_device``);
* ``model_parts``: a model's decoder layers, its input device, and running other functions in place of its
  decoder-layer forwards (the profiler's replay);
* ``continuous_batching``: the paged cache and engine hooks behind ``ripplekv_ext.engines.transformers_cb.serve``.
"""

from ripplekv_ext.integrations.transformers.versions import SUPPORTED_TRANSFORMERS_TEXT

try:
    import transformers  # noqa: F401  (fail here, by name, when it is missing)
except ImportError as error:
    raise ImportError(f"ripplekv_ext's transformers integration needs {SUPPORTED_TRANSFORMERS_TEXT}: "
                      f"pip install '{SUPPORTED_TRANSFORMERS_TEXT}'") from error

from ripplekv_ext.integrations.transformers.attention import (attention_implementation, base_attention,
                                                              eager_attention, registered_attention,
                                                              unique_attention_name)
from ripplekv_ext.integrations.transformers.cache_steps import (cache_classes, cache_device, compress_layer,
                                                                compressed_cache, drop_probe, is_prefill, layer_at,
                                                                new_cache, probe_cache, reselect_layer)
from ripplekv_ext.integrations.transformers.compressed_layer import (CompressedLayer, block_on, close_block,
                                                                     open_block)
from ripplekv_ext.integrations.transformers.model_parts import decoder_layers, forwards_replaced, input_device
from ripplekv_ext.integrations.transformers.reconstruction import (reconstructed_cache, reconstruction_ids,
                                                                  reconstruction_scores)
from ripplekv_ext.integrations.transformers.surprisal import surprisal_cache
from ripplekv_ext.integrations.transformers.versions import cache_argument, check_versions, output_cache

__all__ = ["CompressedLayer", "attention_implementation", "base_attention", "block_on", "cache_argument",
           "cache_classes", "cache_device", "check_versions", "close_block", "compress_layer", "compressed_cache",
           "decoder_layers", "drop_probe", "eager_attention", "forwards_replaced", "input_device", "is_prefill",
           "layer_at", "new_cache", "open_block", "output_cache", "probe_cache", "reconstructed_cache",
           "reconstruction_ids", "reconstruction_scores", "surprisal_cache",
           "registered_attention", "reselect_layer", "unique_attention_name"]
