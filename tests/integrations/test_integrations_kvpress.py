"""RippleKV inside kvpress (ripplekv_ext.integrations.kvpress), in kvpress's own stack (`make test-min` and
`make test-kvpress`, .venv-min): kvpress's pipeline with our presses gives the tokens of ``compress_context`` +
``continue_context`` with the equivalent policy; a kvpress scorer under our budgets keeps kvpress's uniform total and
its own ranking; and every refusal. Elsewhere the module is reported as skipped."""

import pytest

pytest.importorskip("kvpress", reason="kvpress is not installed here: `make test-min` runs these tests in "
                    ".venv-min")

import torch  # noqa: E402
from kvpress import AdaKVPress, ComposedPress, KnormPress, ObservedAttentionPress, SnapKVPress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402
from transformers import pipeline  # noqa: E402

from ripplekv_ext import AdaKVSelector, Policy, compress_context, continue_context  # noqa: E402
from ripplekv_ext.eval.models import shipped_profile_path  # noqa: E402
from ripplekv_ext.eval.tiny_models import tiny_model  # noqa: E402
from ripplekv_ext.integrations.kvpress import (KVPressTotal, RippleKVBudgetPress, RippleKVPress,  # noqa: E402
                                               ScorerPressSelector)
from ripplekv_ext.integrations.transformers import output_cache  # noqa: E402
from ripplekv_ext.budgets.profile_file import Profile  # noqa: E402

torch.set_num_threads(1)
SENSITIVITY = [0.5, 0.05, 0.2, 0.01]


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama", seed=2)
    model.generation_config.eos_token_id = None  # every step generated, in both paths
    return model


def _ids(n, seed=0):
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(seed))


class _Tokenizer:
    """The least of a tokenizer kvpress's pipeline needs, over token ids written as space-separated numbers."""

    chat_template = None
    bos_token = ""
    eos_token_id = None
    pad_token_id = 0
    model_max_length = 1 << 20

    def encode(self, text, return_tensors=None, add_special_tokens=False):
        ids = [int(x) for x in text.split()]
        return torch.tensor([ids]) if return_tensors == "pt" else ids

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(x)) for x in ids)


def _text(ids):
    return " ".join(str(int(x)) for x in ids[0])


def _pipeline_answer(model, press, context, question, new_tokens=8):
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=_Tokenizer(), device="cpu")
    return pipe(_text(context), question=_text(question) + " ", press=press, max_new_tokens=new_tokens)["answer"]


def _reference_answer(model, policy, context, question, new_tokens=8):
    # The pipeline prefills the context (its own tail the window), then the question and a greedy loop.
    cache = compress_context(model, context, policy)
    out = continue_context(model, cache, question, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return " ".join(str(int(x)) for x in out[0, context.shape[1] + question.shape[1]:])


def test_ripplekv_press_in_kvpress_pipeline_equals_compress_context(model):
    context, question = _ids(300), _ids(6, seed=1)
    press = RippleKVPress(compression_ratio=0.8, profile=SENSITIVITY, window=16)
    answer = _pipeline_answer(model, press, context, question)
    assert answer == _reference_answer(model, press.policy(model), context, question)
    assert answer != _pipeline_answer(model, None, context, question)  # compression changed the answer


@pytest.mark.parametrize("scorer", [SnapKVPress(compression_ratio=0.8, window_size=16), KnormPress(0.8)],
                         ids=["snapkv", "knorm"])
def test_kvpress_scorer_under_ripplekv_budgets(model, scorer):
    context, question = _ids(300), _ids(6, seed=1)
    press = RippleKVBudgetPress(press=scorer, profile=SENSITIVITY, window=16)
    policy = press.policy(model)
    # The total is kvpress's uniform press's: 4 layers of compute_n_kept(300, 0.8) tokens.
    budgets = policy.layer_budgets(4, 300)
    assert sum(budgets) == 4 * compute_n_kept(300, 0.8) and len(set(budgets)) > 1
    answer = _pipeline_answer(model, press, context, question)
    with press(model), torch.no_grad():
        cache = output_cache(model(context, use_cache=True))
    assert [layer.keys.shape[2] for layer in cache.layers] == budgets
    if isinstance(scorer, KnormPress):  # its own ranking: the lowest key norms before the window, then the window
        with torch.no_grad():
            full = output_cache(model(context, use_cache=True))
        for layer, budget in zip(range(4), budgets):
            keys = full.layers[layer].keys
            norms = -keys[:, :, :300 - 16].norm(dim=-1)
            kept = norms.topk(budget - 16, dim=-1).indices.sort(-1).values
            expected = torch.cat([keys.gather(2, kept[..., None].expand(-1, -1, -1, keys.shape[-1])),
                                  keys[:, :, 300 - 16:]], dim=2)
            torch.testing.assert_close(cache.layers[layer].keys, expected)
    assert answer == _pipeline_answer(model, press, context, question)  # the same run again: deterministic


def test_adakv_press_splits_each_ripplekv_layer_budget_across_heads(model):
    context, question = _ids(300), _ids(6, seed=1)
    press = RippleKVBudgetPress(press=AdaKVPress(SnapKVPress(compression_ratio=0.8, window_size=16),
                                                 alpha_safeguard=0.3), profile=SENSITIVITY, window=16)
    policy = press.policy(model)
    assert isinstance(policy.selector, AdaKVSelector) and policy.selector.alpha == 0.3
    assert isinstance(policy.selector.scorer, ScorerPressSelector)
    budgets = policy.layer_budgets(4, 300)
    with press(model), torch.no_grad():
        cache = output_cache(model(context, use_cache=True))
    uneven = False
    for layer, budget in zip(cache.layers, budgets):
        per_head = layer.key_mask.sum(dim=-1) if layer.key_mask is not None else None
        held = per_head.sum() if per_head is not None else layer.keys.shape[1] * layer.keys.shape[2]
        assert int(held) == layer.keys.shape[1] * budget  # the layer's RippleKV budget, split across its heads
        uneven |= per_head is not None and len(set(per_head.flatten().tolist())) > 1
    assert uneven
    answer = _pipeline_answer(model, press, context, question)
    assert answer == _pipeline_answer(model, press, context, question)


def test_total_follows_kvpress_rounding():
    allocator = KVPressTotal(Policy.ripplekv(SENSITIVITY, 0.5).allocator, 0.3)
    for n in (97, 255, 1001):
        assert sum(allocator.budgets(4, n, 0, 8)) == 4 * compute_n_kept(n, 0.3)


def test_bad_input_is_refused_by_name(model, tmp_path):
    with pytest.raises(ValueError, match=r"compression_ratio must be a number in \[0, 1\)"):
        RippleKVPress(compression_ratio=1.2, profile=SENSITIVITY)
    with pytest.raises(ValueError, match="profile must be a RippleKV profile"):
        RippleKVPress(compression_ratio=0.5)
    with pytest.raises(TypeError, match="press must be a kvpress ScorerPress"):
        RippleKVBudgetPress(press=object(), profile=SENSITIVITY)
    with pytest.raises(ValueError, match="ObservedAttentionPress scores with the attention weights"):
        RippleKVBudgetPress(press=ObservedAttentionPress(0.5), profile=SENSITIVITY)
    with pytest.raises(ValueError, match=r"one sensitivity per compressible layer \(4\), got 3"):
        RippleKVPress(compression_ratio=0.5, profile=[1.0, 2.0, 3.0]).policy(model)
    # A profile of another model: SmolLM2's shipped one (30 layers) on the tiny model.
    with pytest.raises(ValueError, match="profile is for another model: model.num_layers expected 30"):
        RippleKVPress(compression_ratio=0.5, profile=str(shipped_profile_path("smollm2"))).policy(model)
    profile = Profile.from_sensitivity(model, SENSITIVITY)
    assert RippleKVPress(compression_ratio=0.5, profile=profile).policy(model).allocator.base.sensitivity == SENSITIVITY
    with pytest.raises(TypeError):
        ScorerPressSelector(RippleKVPress(compression_ratio=0.5, profile=SENSITIVITY))


@pytest.mark.parametrize("composed", [
    lambda: ComposedPress([RippleKVPress(compression_ratio=0.5, profile=SENSITIVITY)]),
    lambda: ComposedPress([SnapKVPress(0.5), RippleKVBudgetPress(press=KnormPress(0.5), profile=SENSITIVITY)])],
    ids=["ripplekv-press", "snapkv-then-budget-press"])
def test_a_press_inside_composed_press_is_refused_not_skipped(model, composed):
    # kvpress's ComposedPress calls each press's per-layer hook, which would compress nothing while its ratio counts.
    with pytest.raises(ValueError, match=r"compresses through its own ripplekv_ext.compress block and cannot run "
                                         r"inside another press \(ComposedPress"):
        with composed()(model), torch.no_grad():
            model(_ids(200), use_cache=True)


def test_smollm2_in_kvpress_pipeline_with_its_chat_template():
    from ripplekv_ext.eval.corpus import kjv_text
    from ripplekv_ext.eval.models import load_model

    model, tokenizer, _ = load_model("smollm2")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    context = kjv_text("evaluation")[:4000]
    question = "Who is named first in the text above?"
    press = RippleKVPress(compression_ratio=0.8, profile=str(shipped_profile_path("smollm2")))
    answer = pipe(context, question=question, press=press, max_new_tokens=12)["answer"]
    # The same ids through compress_context + continue_context (the pipeline's own split of context and question).
    ids = pipe.preprocess(context, [question], answer_prefix="", max_context_length=1 << 20)
    cache = compress_context(model, ids["context_ids"], press.policy(model))
    eos = model.generation_config.eos_token_id
    out = continue_context(model, cache, ids["questions_ids"][0], max_new_tokens=12, do_sample=False,
                           eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or 0)
    start = ids["context_ids"].shape[1] + ids["questions_ids"][0].shape[1]
    assert answer == tokenizer.decode(out[0, start:], skip_special_tokens=True)
    assert ids["context_ids"].shape[1] > 800  # long enough that 20% drops most of it


def test_another_kvpress_release_is_refused_by_name(tmp_path):
    # Its press and pipeline internals are what the presses subclass: a release other than the tested one is refused.
    import subprocess
    import sys

    code = ("import importlib.metadata as m; real = m.version; "
            "m.version = lambda name: '0.6.0' if name == 'kvpress' else real(name); "
            "import ripplekv_ext.integrations.kvpress")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0
    assert ("ripplekv_ext.integrations.kvpress was written for kvpress 0.5.5 (its press and pipeline internals); "
            "kvpress 0.6.0 is installed: pip install kvpress==0.5.5") in result.stderr
