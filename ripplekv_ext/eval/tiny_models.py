"""Small random causal LMs of every architecture the package supports, built in memory in seconds (no downloads).

With no model hub reachable they are how one tries the API, an engine adapter or a benchmark harness on llama, qwen2,
mistral, gemma3 (sliding + global layers) and phi3; the tests, the soak runs and ``bench/`` use them for the same
reason, and the tests' subprocesses need them from the installed package.
"""

from __future__ import annotations

import torch

__all__ = ["TINY_ARCHS", "tiny_config", "tiny_model"]

TINY_ARCHS = ("llama", "qwen2", "mistral", "gemma3", "phi3")


def tiny_config(arch: str, num_layers: int = 4, **config_overrides):
    """Config of a small causal LM of the given architecture (no downloads)."""
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  tie_word_embeddings=False)
    if arch == "llama":
        cls = transformers.LlamaConfig
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
    elif arch == "mistral":
        cls = transformers.MistralConfig
        common["sliding_window"] = None
    elif arch == "gemma3":
        cls = transformers.Gemma3TextConfig
        # Alternate sliding / full layers so 4 layers hold both kinds; a window shorter than test prefixes.
        common.update(sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=16)
    elif arch == "phi3":
        cls = transformers.Phi3Config
        common.pop("head_dim")  # Phi3 derives head_dim = hidden / heads = 16
        common.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    else:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    common.update(config_overrides)
    return cls(**common)


def tiny_model(arch: str, seed: int = 0, num_layers: int = 4, **config_overrides):
    """A tiny randomly initialized causal LM of `arch`, deterministic from `seed`, eval mode, SDPA attention."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, num_layers=num_layers, **config_overrides)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model.eval()
    model.name_or_path = f"tiny-{arch}-L{num_layers}-seed{seed}"
    return model
