"""BudgetPlan: every budget question of one policy on one model, answered from the policy's rules, and the one plan
the compressor, the transformers paths and the vLLM engine plan ask."""

import warnings

import pytest
import torch

from ripplekv_ext import BudgetPlan, KVCompressor, Policy
from ripplekv_ext.budgets.allocators import average_budget
from ripplekv_ext.policies import PromptTooShortWarning
from policy_samples import WINDOW, decode_budget_policy, profile_like

LAYERS, COMPRESSIBLE = 6, [0, 2, 3, 5]  # a hybrid model: layers 1 and 4 bound their own cache
SENSITIVITY = [0.5, 0.05, 0.2, 0.01]


def policies():
    return {"snapkv": Policy.snapkv(0.25, window=WINDOW),
            "pyramidkv": Policy.pyramidkv(0.25, window=WINDOW),
            "ripplekv": Policy.ripplekv(profile_like(COMPRESSIBLE, SENSITIVITY), 0.25, window=WINDOW),
            "bounded": Policy.snapkv(0.25, window=WINDOW, prefill_chunk=24),
            "decode": decode_budget_policy(0.25)}


@pytest.fixture(params=list(policies()))
def policy(request):
    return policies()[request.param]


def test_a_prompt_s_budgets_are_the_policy_s_rule_on_the_compressible_layers(policy):
    plan = BudgetPlan(policy, LAYERS, COMPRESSIBLE)
    for n in (5, 40, 97, 300):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PromptTooShortWarning)
            rule = policy.layer_budgets(len(COMPRESSIBLE), n, COMPRESSIBLE)
            budgets = plan.prompt(n)
        assert [budgets[layer] for layer in COMPRESSIBLE] == rule
        assert [budgets[layer] for layer in (1, 4)] == [None, None]
        assert [plan.layer(layer, n) for layer in range(LAYERS)] == budgets
    # Past the window the layers share the average budget's total (SnapKV, PyramidKV and RippleKV alike), which a
    # decode budget caps.
    average = average_budget(0.25, 300)
    if policy.decode_budget is not None:
        average = min(average, policy.decode_budget)
    assert sum(plan.prompt(300)[layer] for layer in COMPRESSIBLE) == len(COMPRESSIBLE) * average


def test_a_chunk_keeps_every_token_read_up_to_the_final_budget(policy):
    plan = BudgetPlan(policy, LAYERS, COMPRESSIBLE)
    final = plan.prompt(300)
    for layer in COMPRESSIBLE:
        kept = [plan.chunk(n_read, 300)[layer] for n_read in range(1, 301)]
        assert kept == [min(n_read, final[layer]) for n_read in range(1, 301)]
        assert [plan.layer_chunk(layer, n_read, 300) for n_read in range(1, 301)] == kept
    assert plan.chunk(300, 300) == final
    assert plan.layer_chunk(1, 100, 300) is None
    # Without the whole length, a chunk is planned as a prompt of the tokens read so far.
    assert plan.chunk(120) == plan.prompt(120)


def test_decoding_budgets_keep_the_generation_s_total_at_every_length():
    policy = decode_budget_policy(0.25)
    plan = BudgetPlan(policy, LAYERS, COMPRESSIBLE)
    for seen in (40, 41, 90, 500):
        budgets = plan.decode(seen, 40)
        assert [budgets[layer] for layer in (1, 4)] == [None, None]
        assert sum(budgets[layer] for layer in COMPRESSIBLE) == len(COMPRESSIBLE) * policy.decode_budget
    with pytest.raises(ValueError, match="does not compress during decoding"):
        BudgetPlan(Policy.snapkv(0.25, window=WINDOW), LAYERS).decode(50, 40)


def test_each_row_of_a_batch_is_planned_as_its_own_prompt(policy):
    plan = BudgetPlan(policy, LAYERS, COMPRESSIBLE)
    lengths = [300, 0, 97]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooShortWarning)
        rows = plan.rows(torch.tensor(lengths))
        assert rows[0] == plan.prompt(300) and rows[2] == plan.prompt(97)
        assert rows[1] == [0 if layer in COMPRESSIBLE else None for layer in range(LAYERS)]
        for layer in range(LAYERS):
            assert plan.layer_rows(layer, lengths) == (None if layer not in COMPRESSIBLE else
                                                       [row[layer] for row in rows])


def test_only_an_allocator_that_reads_attention_reads_the_windows():
    # Any other policy answers from_attention with its prompt budgets, whatever the windows hold.
    plan = BudgetPlan(Policy.snapkv(0.25, window=WINDOW), LAYERS, COMPRESSIBLE)
    assert plan.from_attention({}, 120) == plan.prompt(120)


def test_the_compressor_and_the_vllm_engine_plan_ask_one_plan():
    policy = Policy.pyramidkv(0.25, window=WINDOW, decode_every=4, prefill_chunk=24)
    compressor = KVCompressor(policy, LAYERS, COMPRESSIBLE)
    assert isinstance(compressor.plan, BudgetPlan)
    assert compressor.budgets(300) == compressor.plan.prompt(300)
    assert compressor.chunk_budgets(100, 300) == compressor.plan.chunk(100, 300)
    assert compressor.decode_budgets(340, 300) == compressor.plan.decode(340, 300)
    assert compressor.row_budgets([300, 97]) == compressor.plan.rows([300, 97])
    pytest.importorskip("ripplekv_ext.engines.vllm.settings")
    from ripplekv_ext.engines.vllm.settings import Settings
    from ripplekv_ext.engines.vllm.plan import plan_for

    engine = plan_for(Settings.from_config({"method": "pyramidkv", "retention": 0.25, "tiers": 2}), LAYERS, 32)
    assert engine.budgets is engine.compressor.plan
    for tier, layers in enumerate(engine.tiers):
        assert engine.tier_budget(tier, 640) == engine.budgets.layer(layers[0], 640)


@pytest.mark.parametrize("args,error,message", [
    (("snapkv", 4, None), TypeError, "policy must be a ripplekv_ext.Policy"),
    ((None, 0, None), ValueError, "num_layers"),
    ((None, 4, [0, 4]), ValueError, r"compressible_layers must be distinct indices in \[0, 4\)"),
    ((None, 4, [1, 1]), ValueError, "compressible_layers must be distinct"),
    ((None, 4, [1.5]), ValueError, "compressible_layers must be distinct"),
])
def test_a_plan_of_bad_arguments_is_refused_by_name(args, error, message):
    policy, num_layers, layers = args
    with pytest.raises(error, match=message):
        BudgetPlan(Policy.snapkv(0.25) if policy is None else policy, num_layers, layers)
    with pytest.raises(ValueError, match=r"layer_idx must be an integer in \[0, 6\), got 6"):
        BudgetPlan(Policy.snapkv(0.25), LAYERS).layer(6, 100)
