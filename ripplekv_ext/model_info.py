"""What the library needs to know about a transformers model: its text config and which layers to compress.

Works on a model or a config object and imports nothing from transformers, so the core library stays free of it.
"""

from __future__ import annotations

__all__ = ["text_config", "layer_types", "compressible_layers", "sliding_window"]


def text_config(model_or_config):
    """The config of the text decoder: the config itself for text models, its text part for multimodal ones."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def layer_types(model_or_config) -> list[str]:
    """Per-layer attention kind: "full_attention" or "sliding_attention"."""
    config = text_config(model_or_config)
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    window = getattr(config, "sliding_window", None)
    use_window = getattr(config, "use_sliding_window", True)
    if window is not None and use_window:
        max_window_layers = getattr(config, "max_window_layers", None)
        if max_window_layers is not None and getattr(config, "model_type", "") == "qwen2":
            # Qwen2: layers >= max_window_layers use the sliding window.
            return ["full_attention" if i < max_window_layers else "sliding_attention" for i in range(n)]
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def compressible_layers(model_or_config) -> list[int]:
    """Indices of layers with full (global) attention. Sliding-window layers already bound their cache."""
    return [i for i, t in enumerate(layer_types(model_or_config)) if t == "full_attention"]


def sliding_window(model_or_config):
    """The token window of the model's sliding-window layers, or None when it has none."""
    if "sliding_attention" not in layer_types(model_or_config):
        return None
    return getattr(text_config(model_or_config), "sliding_window", None)
