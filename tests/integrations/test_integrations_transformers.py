"""The transformers integration (ripplekv_ext.integrations.transformers): the supported version ranges and the
adapters within them (``versions``), and what ``CompressedLayer`` keeps of its own (logical lengths under crop, the
decode state that follows its rows).

`make test` runs this file twice: in .venv (the newest pinned transformers) and in .venv-min (the oldest supported
one), so every adapter is checked against the transformers it adapts to, on both ends of the range.
"""

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from ripplekv_ext import Policy, compress
from ripplekv_ext.integrations.transformers import versions as _compat
from ripplekv_ext.budgets.allocators import average_budget

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: E402

from ripplekv_ext.eval.tiny_models import tiny_model  # noqa: E402
from ripplekv_ext.integrations.transformers import CompressedLayer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _report_transformers_version(monkeypatch, version):
    # The module now in sys.modules: transformers 5.2 replaces its lazy module object while building a model, so
    # the one imported at the top of this file may no longer be the one `import transformers` returns.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=2)


# --- the ranges -------------------------------------------------------------------------------------------------

def test_installed_versions_are_supported():
    _compat.check_versions()


@pytest.mark.parametrize("version", ["4.57.6", "5.1.0", "6.0.0", "6.0.0rc1", "6.1.0.dev0"])
def test_compress_refuses_unsupported_transformers(model, monkeypatch, version):
    _report_transformers_version(monkeypatch, version)
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError) as err:
        with compress(model, Policy.snapkv(0.3)):
            pass
    message = str(err.value)
    assert f"transformers {version} is installed" in message
    assert "transformers>=5.2,<6" in message
    assert model.config._attn_implementation == before  # refused before touching the model


@pytest.mark.parametrize("version", ["2.9.1", "2.12.0+cpu", "1.13.1"])
def test_compress_refuses_unsupported_torch(model, monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    message = f"torch {version} is installed, ripplekv_ext supports torch>=2.13"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        with compress(model, Policy.snapkv(0.3)):
            pass


def test_allow_unsupported_turns_the_error_into_a_warning(model, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setenv("RIPPLEKV_ALLOW_UNSUPPORTED", "1")
    with pytest.warns(_compat.UnsupportedVersionWarning, match=re.escape("torch 2.11.0+cu130 is installed")):
        with compress(model, Policy.snapkv(0.3)):
            pass
    monkeypatch.setenv("RIPPLEKV_ALLOW_UNSUPPORTED", "0")  # only "1" lets it go on
    with pytest.raises(RuntimeError, match="RIPPLEKV_ALLOW_UNSUPPORTED=1"):
        with compress(model, Policy.snapkv(0.3)):
            pass


@pytest.mark.parametrize("version", ["5.2.0", "5.2.1", "5.24.0", "5.99.0.dev0"])
def test_compress_accepts_supported_transformers(model, monkeypatch, version):
    _report_transformers_version(monkeypatch, version)
    with compress(model, Policy.snapkv(0.3)):
        pass


def test_missing_transformers_is_named(monkeypatch):
    monkeypatch.setattr(_compat, "installed_versions", lambda: {"torch": "2.14.1", "transformers": None})
    with pytest.raises(RuntimeError, match="transformers is not installed"):
        _compat.check_versions()


@pytest.mark.parametrize("version, release", [("2.13.0+cpu", (2, 13, 0)), ("5.3.0.dev0", (5, 3, 0)),
                                              ("6.0.0rc1", (6, 0, 0)), ("2.14.1", (2, 14, 1)), ("5.2", (5, 2))])
def test_release_parsing(version, release):
    assert _compat._release(version) == release


def test_declared_ranges_match_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The dependencies are setup.py's: a source install's range, a build's own torch release (tests/test_dist.py).
    assert "dependencies" in project["dynamic"]
    body = ast.parse((ROOT / "setup.py").read_text()).body
    (source_requirements,) = [ast.literal_eval(node.value) for node in body
                              if isinstance(node, ast.Assign)
                              and getattr(node.targets[0], "id", "") == "SOURCE_REQUIREMENTS"]
    assert _compat.SUPPORTED_TORCH_TEXT in source_requirements
    assert _compat.SUPPORTED_TRANSFORMERS_TEXT in project["optional-dependencies"]["eval"]


# --- the adapters, against the installed transformers -----------------------------------------------------------

def test_cache_argument_is_what_the_models_take():
    from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel

    for cls in (LlamaModel, LlamaForCausalLM):
        assert _compat.cache_argument() in inspect.signature(cls.forward).parameters


def test_output_cache_is_the_returned_cache(model):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.arange(3, 13)[None], use_cache=True, **{_compat.cache_argument(): cache})
    assert _compat.output_cache(out) is cache
    assert cache.get_seq_length() == 10


def test_query_length_from_either_argument():
    assert _compat.query_length(5) == 5
    assert _compat.query_length(torch.arange(17, 22)) == 5


def _layer(n_tokens, seen=None):
    keys = torch.randn(1, 2, n_tokens, 4)
    if seen is None:
        layer = DynamicLayer()
        layer.update(keys, keys.clone())
        return layer
    return CompressedLayer(keys, keys.clone(), seen_tokens=seen)


@pytest.mark.parametrize("argument", [-3, 0, -10])
def test_tokens_to_remove_matches_the_installed_crop(argument):
    layer = _layer(10)
    layer.crop(argument)
    assert _compat.tokens_to_remove(argument, 10) == 10 - layer.get_seq_length()


def test_compressed_layer_crop_counts_logical_tokens():
    # The removed tokens are the newest, which compression kept: physical and seen lengths drop together.
    layer = _layer(20, seen=100)
    layer.crop(-3)
    assert (layer.physical_length, layer.get_seq_length()) == (17, 97)
    if _compat._crop_takes_target_length():  # transformers 5.2: crop(max_length), in seen tokens
        layer.crop(95)
        assert (layer.physical_length, layer.get_seq_length()) == (15, 95)
    else:
        layer.crop(0)
        assert (layer.physical_length, layer.get_seq_length()) == (17, 97)


def test_cache_crop_through_compressed_layers(model):
    # What assisted decoding does: drop the last tokens of the whole cache, under the installed crop convention.
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), compress(model, Policy.snapkv(0.25, window=8)):
        cache = _compat.output_cache(model(ids, use_cache=True))
        physical = [layer.physical_length for layer in cache.layers]
        cache.crop(-4)
        assert cache.get_seq_length() == 60
        assert [layer.physical_length for layer in cache.layers] == [p - 4 for p in physical]


def test_generate_under_compression(model):
    """The first `generate` under compress() must not die in transformers' sdpa_mask on 5.2 (it once did)."""
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), compress(model, Policy.snapkv(0.25, window=8)) as session:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert out.shape == (1, 70)
    assert session.last_budgets == {0: average_budget(0.25, 64), 1: average_budget(0.25, 64)}


# --- CompressedLayer's decode state follows its rows ------------------------------------------------------------

def test_batch_reshuffles_move_the_decode_state_with_the_rows():
    # Beam search and sampled repeats reorder a compressed layer's rows: the newest queries and the prompt lengths
    # that set each row's budgets must follow them.
    keys = torch.arange(3.0)[:, None, None, None].expand(3, 1, 5, 2).contiguous()
    layer = CompressedLayer(keys, keys.clone(), seen_tokens=5)
    layer.remember_queries(torch.arange(3.0)[:, None, None, None].expand(3, 2, 6, 2), window=4)
    layer.prompt_lengths = torch.tensor([5, 4, 3])
    assert layer.recent_queries.shape == (3, 2, 4, 2)
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert layer.prompt_lengths.tolist() == [3, 5, 4] and layer.recent_queries[:, 0, 0, 0].tolist() == [2, 0, 1]
    layer.batch_select_indices(torch.tensor([0, 2]))
    assert layer.prompt_lengths.tolist() == [3, 4] and layer.keys[:, 0, 0, 0].tolist() == [2, 1]
    layer.batch_repeat_interleave(2)
    assert layer.prompt_lengths.tolist() == [3, 3, 4, 4] and layer.recent_queries[:, 0, 0, 0].tolist() == [2, 2, 1, 1]


def test_probe_cache_holds_the_probe_beyond_each_sliding_window_and_no_more():
    # gemma3's tiny sliding layers (window 16) would lose context tokens to a probe; the probe's cache keeps a window
    # longer by the probe (not every token: a sliding layer's memory stays bounded), and drop_probe leaves exactly
    # what the stock prefill of the context leaves.
    from ripplekv_ext.integrations.transformers import drop_probe, output_cache, probe_cache

    model = tiny_model("gemma3")
    context, probe = torch.randint(3, 512, (1, 96)), torch.randint(3, 512, (1, 12))
    with torch.no_grad():
        stock = output_cache(model(context, use_cache=True))
        cache = output_cache(model(torch.cat([context, probe], 1), use_cache=True,
                                   **{_compat.cache_argument(): probe_cache(model, 12)}))
    sliding = [i for i, layer in enumerate(stock.layers) if getattr(layer, "is_sliding", False)]
    assert sliding and all(cache.layers[i].keys.shape[2] == 16 - 1 + 12 for i in sliding)
    drop_probe(cache, 12)
    for layer, expected in zip(cache.layers, stock.layers):
        assert type(layer) is type(expected) and layer.get_seq_length() == expected.get_seq_length() == 96
        # A forward of 108 tokens against one of 96: the same keys within the rounding of another shape.
        torch.testing.assert_close(layer.keys, expected.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(layer.values, expected.values, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="probe_tokens must be at least 1"):
        drop_probe(cache, 0)
