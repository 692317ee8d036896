"""Compression while decoding (``decode_every`` / ``decode_budget``, the hook's meaning), on the tiny random Llama,
engines in this process: every ``K`` generated tokens each compressed layer selects down to its budget again (the
newest ``W`` tokens kept, scored with the newest ``W`` queries), the kept tokens compacted in the request's own
blocks and the emptied blocks returned to the pool. Each request's tokens equal the hook's,
``compress(model, plan.policy)`` + ``generate`` with the same settings, and a request's blocks stay flat however long
it generates."""

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from vllm import SamplingParams  # noqa: E402

from harness import (BLOCK, LAYERS, config, engine, greedy, held_blocks, prompts, reference,  # noqa: E402
                     scheduler)
from ripplekv_ext.engines.vllm.settings import Settings  # noqa: E402
from ripplekv_ext.engines.vllm.plan import plan_for  # noqa: E402

DECODE = {"decode_every": 16, "decode_budget": 96}
NEW = 120


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2, **DECODE},
                                      {"method": "ripplekv", "retention": 0.3, "tiers": 2, "prefill_chunk": 64,
                                       "decode_every": 24},
                                      {"method": "snapkv", "retention": 0.2, **DECODE, "protect_prefix": 64}],
                         ids=["snapkv", "ripplekv-2tiers-bounded", "snapkv-protected"])
def test_tokens_equal_the_hook_s_with_the_same_decode_settings(model_dir, hf_model, profile_path, ripplekv):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = prompts([20, 100, 270, 333], seed=2)
    with engine(model_dir, ripplekv, max_num_batched_tokens=128) as llm:
        batched = greedy(llm, token_lists, new_tokens=NEW)
        alone = greedy(llm, token_lists[2:3], new_tokens=NEW)
    expected = reference(hf_model, plan.policy, token_lists, new_tokens=NEW)
    assert batched == expected and alone == expected[2:3]


def test_a_long_generation_holds_its_budget_plus_a_step_and_a_block(model_dir, hf_model):
    """A 270-token prompt generating 600 tokens: stock vLLM's blocks grow with the sequence (28 at the end); with
    decode compression the request never holds more than its aligned budget, ``K`` tokens and a block, and the
    tokens are the hook's, which differ from those of compression at the prompt only."""
    ripplekv = {"method": "snapkv", "retention": 0.2, **DECODE}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    tokens = prompts([270], seed=4)
    new = 600
    held = []
    with engine(model_dir, ripplekv, max_model_len=1024) as llm:
        engine_ = llm.llm_engine
        engine_.add_request("0", {"prompt_token_ids": tokens[0]}, SamplingParams(temperature=0, max_tokens=new,
                                                                                 ignore_eos=True))
        output = None
        while engine_.has_unfinished_requests():
            for out in engine_.step():
                output = list(out.outputs[0].token_ids) if out.finished else output
            held.append(held_blocks(llm, "0"))
        assert max(held) > 0  # the request was found in the scheduler's pool
        pool = scheduler(llm).kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    # The largest aligned decode budget of any step, plus K generated tokens, plus the block being filled.
    budgets = [plan.compressor.decode_budgets(270 + step, 270)[0] for step in range(16, new + 1, 16)]
    bound = -(-(max(budgets) + DECODE["decode_every"]) // BLOCK) + 1
    # The prefill's step holds the prompt (9 blocks); every decoding step after it stays within the bound, where
    # stock vLLM ends at 28.
    assert held[0] == 9 and max(held[1:]) <= bound < -(-(270 + new) // BLOCK)
    assert [output] == reference(hf_model, plan.policy, tokens, new_tokens=new)
    one_shot = plan_for(Settings.from_config({"method": "snapkv", "retention": 0.2}), LAYERS, BLOCK).policy
    assert [output] != reference(hf_model, one_shot, tokens, new_tokens=new)


def test_preempted_requests_and_shared_prefixes_give_the_hook_s_tokens(model_dir, hf_model, profile_path):
    """Requests preempted after compactions while decoding (vLLM's reset_prefix_cache with running requests), with
    a protected prefix, recompute prompt and output, compacted again at every boundary they pass (the prompt's
    chunks and every ``K`` generated tokens); with prefix caching the questions of a shared document read it from
    the cache, and a prompt shorter than its decode budget (kept whole at its end) is first compacted while
    decoding, its shared blocks untouched."""
    from harness import run_first_then_rest, shared_prefix_prompts

    # A protected prefix too: its blocks are recomputed whole, and never compacted.
    ripplekv = {"method": "ripplekv", "retention": 0.2, "tiers": 2, "prefill_chunk": 64, "decode_every": 24,
                "protect_prefix": 64, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = prompts([270, 333], seed=1)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outputs = {}
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=1024) as llm:
        engine_ = llm.llm_engine
        sched = scheduler(llm)
        for i, tokens in enumerate(token_lists):
            engine_.add_request(str(i), {"prompt_token_ids": tokens}, params)
        while not all(r.num_output_tokens > 30 for r in sched.running):
            engine_.step()
        assert llm.reset_prefix_cache(reset_running_requests=True)
        while engine_.has_unfinished_requests():
            outputs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine_.step() if o.finished})
    assert [outputs["0"], outputs["1"]] == reference(hf_model, plan.policy, token_lists, new_tokens=NEW)

    snapkv = {"method": "snapkv", "retention": 0.2, **DECODE}
    plan = plan_for(Settings.from_config(snapkv), LAYERS, BLOCK)
    shared = shared_prefix_prompts()[:3] + prompts([60], seed=9)
    assert 60 < plan.first_compaction(60) < 60 + NEW  # kept whole at the prompt's end, compacted while decoding
    with engine(model_dir, snapkv, enable_prefix_caching=True, max_num_batched_tokens=1024) as llm:
        tokens, cached = run_first_then_rest(llm, shared, new_tokens=NEW)
    assert tokens == reference(hf_model, plan.policy, shared, new_tokens=NEW)
    assert cached[1:3] == [320, 320]


@pytest.mark.parametrize("settings,message", [
    ({"decode_every": 0}, r'\["decode_every"\] must be an integer >= 1 .*got 0'),
    ({"decode_every": 2.5}, r'\["decode_every"\] must be an integer >= 1 .*got 2.5'),
    ({"decode_every": "16"}, r'\["decode_every"\] must be an integer >= 1 .*got \'16\''),
    ({"decode_every": 16, "decode_budget": 32}, r"decode_budget must be an integer > window = 32 .*got 32"),
    ({"decode_budget": 96}, r"decode_budget=96 needs decode_every"),
    ({"decode_every": 1024}, r'\["decode_every"\]=1024 is not below max_model_len=1024'),
], ids=["zero", "fraction", "string", "budget-at-window", "budget-alone", "every-beyond-the-model"])
def test_bad_decode_settings_are_refused_by_name(model_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        config(model_dir, {"method": "snapkv", "retention": 0.2, **settings})


REAL_MODELS = {  # model -> decode settings, prompt lengths, vocabulary drawn from
    "smollm2": ({"method": "ripplekv", "retention": 0.2, "tiers": 5, "decode_every": 32, "decode_budget": 128},
                [300, 700], 40000),
    "gemma3-270m": ({"method": "ripplekv", "retention": 0.2, "tiers": 3, "prefill_chunk": 256, "decode_every": 64},
                    [600, 900], 20000),
}


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_real_models_generate_the_hook_s_tokens_while_compressing_their_generation(name):
    """SmolLM2-135M (30 layers in 5 tiers) and gemma-3-270m (its 3 full-attention layers, bounded prefill), each with
    its shipped profile, two prompts batched, 72 tokens generated: compacted every K of them (twice on SmolLM2, once
    on gemma-3-270m, each with tokens generated after the last compaction). Each request equals the hook on its prompt
    alone."""
    from transformers import AutoConfig

    from harness import running
    from ripplekv_ext.engines.vllm.plan import plan_for_model
    from ripplekv_ext.engines.vllm.sizing import kv_cache_bytes
    from ripplekv_ext.eval.models import converted_folder, shipped_profile_path
    from tiny_llama import load_reference_model

    folder = converted_folder(name)
    if not (folder / "config.json").is_file():
        pytest.skip(f"{name} not converted at {folder}: `make test` converts it before `make test-vllm` runs")
    settings, lengths, vocab = REAL_MODELS[name]
    ripplekv = {**settings, "profile": str(shipped_profile_path(name))}
    model_config = AutoConfig.from_pretrained(folder)
    plan = plan_for_model(Settings.from_config(ripplekv), model_config, BLOCK)
    token_lists = prompts(lengths, seed=0, vocab=vocab)
    params = dict(model=str(folder), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=BLOCK,
                  max_model_len=2048, kv_cache_memory_bytes=kv_cache_bytes(model_config, 200, BLOCK, 4),
                  max_num_batched_tokens=512, additional_config={"ripplekv": ripplekv})
    new = 72
    with running(**params) as llm:
        batched = greedy(llm, token_lists, new_tokens=new)
    assert batched == reference(load_reference_model(folder), plan.policy, token_lists, new_tokens=new)
