"""What the plugin runs in each vLLM worker process: the CPU attention backend that compacts each request's cache
(``attention``) and the reads and writes of vLLM's paged cache layout (``cache_layout``)."""
