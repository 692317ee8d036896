"""What the plugin runs in vLLM's scheduler process: the KV cache manager of each tier (``manager``)."""
