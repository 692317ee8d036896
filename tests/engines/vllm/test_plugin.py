"""The vLLM plugin on a tiny random Llama (4 layers, head size 32, float32), engines running in this process.

What is checked: the plugin loads through its entry point and runs stock vLLM unless asked; with budgets covering
the prompt its tokens equal stock vLLM's; compressed, each request's tokens equal ``ripplekv_ext.compress`` with the
engine's own (block-aligned, tiered) policy + transformers ``generate`` on that prompt alone, through chunked
prefills and preemption; blocks go back to the pool after each prefill and on finish; the version guard and every
refusal.
"""

import gc
import json
import re
import subprocess
import sys

import pytest

# Where vLLM is not installed (`make test-vllm` installs it in .venv-vllm), the module is reported as skipped. The
# import names a module of vLLM's, not this folder, which imports as a namespace package "vllm".
pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed import cleanup_dist_env_and_memory  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from harness import (BLOCK, LAYERS, config, engine, engine_kwargs, greedy, held_blocks, prompts,  # noqa: E402
                     reference, scheduler)
from ripplekv_ext.engines import vllm as plugin  # noqa: E402
from ripplekv_ext.engines.vllm import checks  # noqa: E402
from ripplekv_ext.engines.vllm.worker.attention import RippleKVCPUImpl  # noqa: E402
from ripplekv_ext.engines.vllm.settings import Settings  # noqa: E402
from ripplekv_ext.engines.vllm.plan import plan_for  # noqa: E402
from ripplekv_ext.engines.vllm.sizing import held_tokens_bound, kv_cache_bytes  # noqa: E402
from policy_samples import SAMPLE_NAMES, sample_method, sample_policies  # noqa: E402
from tiny_llama import LLAMA_CONFIG  # noqa: E402


@pytest.fixture(scope="module")
def stock_tokens(model_dir):
    with engine(model_dir) as llm:
        return greedy(llm, prompts())


# -- loading ----------------------------------------------------------------------------------------------------------

def test_entry_point_registers_the_plugin():
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("ripplekv") == "ripplekv_ext.engines.vllm:register"


def test_a_checkout_that_shadows_the_installed_package_says_so(tmp_path):
    # `python -m vllm.entrypoints.openai.api_server` from a checkout imports its ripplekv_ext (no compiled library)
    # before the installed one: vLLM then logs that the plugin failed to load. The error says why and what to do.
    import shutil
    from pathlib import Path

    import ripplekv_ext

    installed = Path(ripplekv_ext.__file__).resolve().parent
    checkout = tmp_path / "checkout"
    shutil.copytree(installed, checkout / "ripplekv_ext", ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    (checkout / "setup.py").write_text("# a source checkout\n")
    out = subprocess.run([sys.executable, "-c", "import ripplekv_ext"], cwd=checkout, capture_output=True, text=True)
    assert out.returncode != 0
    assert (f"this is the source checkout's ripplekv_ext ({checkout / 'ripplekv_ext'}), which has no compiled "
            f"library, imported before the installed one ({installed})") in out.stderr, out.stderr
    assert "start from another folder" in out.stderr


def test_an_engine_says_the_plugin_is_active_and_warns_when_blocks_keep_far_more(model_dir):
    import logging

    records = []

    def record(entry):  # a filter, not a handler: vLLM's logging set-up clears its loggers' handlers
        records.append(entry)
        return True

    logger = logging.getLogger("vllm.ripplekv")
    logger.addFilter(record)
    try:
        config(model_dir, {"method": "snapkv", "retention": 0.1})
        assert [r.levelname for r in records] == ["INFO"]
        config(model_dir, {"method": "snapkv", "retention": 0.1}, block_size=128)
        # A protected prefix keeps more than the retention by itself: named, and no block-size warning.
        config(model_dir, {"method": "snapkv", "retention": 0.3, "protect_prefix": 256})
        config(model_dir, {"method": "snapkv", "retention": 0.2, "compress_prefix": 1024})
    finally:
        logger.removeFilter(record)
    messages = [r.getMessage() for r in records]
    assert [r.levelname for r in records[3:]] == ["INFO", "INFO"]
    # 256 protected + 96 of the 256 after them (a budget of 77, in whole blocks): 352 of 512.
    assert "prefill_chunk None, protect_prefix 256, prefix caching off; a request keeps 69% of 512" in messages[3]
    # 1,024 tokens at 20%: a budget of 205, 224 in whole blocks (22%); a 512-token prompt keeps 128 (25%).
    assert ("compress_prefix 1024 (a longer prompt keeps 22% of its first 1024 tokens and the rest whole), prefix "
            "caching off; a request keeps 25% of 512 tokens, 22% of 1024 tokens of its prompt") in messages[4]
    assert messages[0] == ("ripplekv plugin active: snapkv at retention 0.1, 1 tier(s), window 32, block size 32, "
                           "prefill_chunk None, prefix caching off; a request keeps 12% of 512 tokens of its prompt "
                           "(whole blocks only)")
    # 128-token blocks: 512 - 128 x floor((512 - 51) / 128) = 128 tokens kept of 512.
    assert "block size 128" in messages[1] and "keeps 25% of 512 tokens" in messages[1]
    assert messages[2] == ("ripplekv plugin: with 128-token blocks a retention of 0.1 keeps 25% of a 512-token "
                           "prompt (whole blocks only; 12% with --block-size 32)")


def test_plugin_is_loaded_by_vllm_and_stock_engines_stay_stock(model_dir, stock_tokens):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    # vLLM loaded the plugin through the entry point when it built the stock engine (stock_tokens).
    assert AttentionBackendEnum.CPU_ATTN.get_path() == "ripplekv_ext.engines.vllm.worker.attention.RippleKVCPUBackend"
    with engine(model_dir) as llm:
        managers = scheduler(llm).kv_cache_manager.coordinator.single_type_managers
        assert [type(m) for m in managers] == [FullAttentionManager]
        assert greedy(llm, prompts()[:2]) == stock_tokens[:2]


def test_engines_start_on_a_machine_with_little_memory(model_dir, monkeypatch):
    # vLLM's CPU worker reads the NUMA node's memory: reported as 2 GiB (1.5 free), an engine sized by a memory
    # fraction gets a KV budget below the process's resident memory and refuses to start; one sized in bytes starts.
    from vllm.platforms import cpu as cpu_platform
    from vllm.utils.cpu_resource_utils import MemoryNodeInfo
    from vllm.v1.worker import cpu_worker

    small = MemoryNodeInfo(total_memory=2 * 2**30, available_memory=3 * 2**29)
    for module in (cpu_worker, cpu_platform):
        monkeypatch.setattr(module, "get_memory_node_info", lambda node=0: small)
    kwargs = engine_kwargs(model_dir, {"method": "snapkv", "retention": 0.2})
    with engine(model_dir, {"method": "snapkv", "retention": 0.2}) as llm:
        assert len(greedy(llm, prompts()[:1], new_tokens=2)[0]) == 2
    del kwargs["kv_cache_memory_bytes"]
    with pytest.raises(Exception, match="less than requested memory for kv"):
        LLM(**kwargs, gpu_memory_utilization=0.05)
    gc.collect()
    cleanup_dist_env_and_memory()


# -- tokens ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 1.0},
                                      {"method": "pyramidkv", "retention": 1.0, "tiers": 2}],
                         ids=["snapkv-1.0", "pyramidkv-1.0-2tiers"])
def test_budgets_covering_the_prompt_give_stock_tokens(model_dir, stock_tokens, ripplekv):
    # Chunked prefills (64 tokens a step) with several requests in flight: the plugin's paths all run.
    with engine(model_dir, ripplekv, max_num_batched_tokens=64) as llm:
        assert greedy(llm, prompts()) == stock_tokens


COMPRESSED = [
    ({"method": "snapkv", "retention": 0.2}, 1),
    ({"method": "ripplekv", "retention": 0.2, "tiers": 2}, 2),
    ({"method": "pyramidkv", "retention": 0.3}, LAYERS),  # default: one tier per layer
    ({"method": "streamingllm", "retention": 0.2}, 1),
]


@pytest.mark.parametrize("ripplekv,num_tiers", COMPRESSED, ids=["snapkv", "ripplekv-2tiers", "pyramidkv-4tiers",
                                                                "streamingllm"])
def test_compressed_tokens_equal_compress_and_generate(model_dir, hf_model, profile_path, stock_tokens, ripplekv,
                                                       num_tiers):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    # Chunks of 64 tokens: the last chunk of the 270-token prompt holds 14 of the 32 window queries.
    with engine(model_dir, ripplekv, max_num_batched_tokens=64) as llm:
        assert len(scheduler(llm).kv_cache_manager.coordinator.single_type_managers) == num_tiers
        tokens = greedy(llm, prompts())
    assert tokens == reference(hf_model, plan.policy, prompts())
    assert any(t != s for t, s in zip(tokens, stock_tokens))  # compression changed some answer
    assert tokens[0] == stock_tokens[0]  # shorter than the window: never compressed


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2},
                                      {"method": "snapkv", "retention": 0.2, "prefill_chunk": 64}],
                         ids=["one-shot", "bounded-prefill"])
def test_preempted_requests_recompute_to_the_same_tokens(model_dir, hf_model, monkeypatch, ripplekv):
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    split_steps = []
    attend_part = RippleKVCPUImpl._attend_part

    def counting(self, layer, query, key, value, kv_cache, meta, output, tokens):
        split_steps.append(meta)
        return attend_part(self, layer, query, key, value, kv_cache, meta, output, tokens)

    monkeypatch.setattr(RippleKVCPUImpl, "_attend_part", counting)
    token_lists = prompts([270, 300, 240, 333], seed=1)
    # 14 usable blocks for four requests growing by 100 tokens each: a decoding request gets preempted, then
    # recomputes its prompt and output in one step that runs past its prompt's end.
    with engine(model_dir, ripplekv, blocks=15, max_model_len=448, max_num_seqs=4) as llm:
        sched = scheduler(llm)
        preempted = []
        preempt = sched._preempt_request
        monkeypatch.setattr(sched, "_preempt_request", lambda request, *a, **k: (preempted.append(request.request_id),
                                                                                 preempt(request, *a, **k))[1])
        tokens = greedy(llm, token_lists, new_tokens=100)
    assert preempted and split_steps
    assert tokens == reference(hf_model, plan.policy, token_lists, new_tokens=100)


# -- bounded prefill --------------------------------------------------------------------------------------------------

BOUNDED = [
    ({"method": "snapkv", "retention": 0.2, "prefill_chunk": 64}, 64),
    # Steps of 160 tokens cross the boundaries of 96-token chunks mid-step, and span several requests.
    ({"method": "ripplekv", "retention": 0.2, "tiers": 2, "prefill_chunk": 96}, 160),
]


@pytest.mark.parametrize("ripplekv,step_tokens", BOUNDED, ids=["snapkv-chunk64", "ripplekv-2tiers-chunk96-steps160"])
def test_bounded_prefill_tokens_equal_compress_and_generate(model_dir, hf_model, profile_path, stock_tokens,
                                                            ripplekv, step_tokens):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    assert plan.policy.prefill_chunk == ripplekv["prefill_chunk"]
    with engine(model_dir, ripplekv, max_num_batched_tokens=step_tokens) as llm:
        tokens = greedy(llm, prompts())
    # The reference reads each prompt in chunks of prefill_chunk (the policy's), compressed after each.
    assert tokens == reference(hf_model, plan.policy, prompts())
    one_shot = plan_for(Settings.from_config({k: v for k, v in ripplekv.items() if k != "prefill_chunk"}), LAYERS,
                        BLOCK)
    assert tokens != reference(hf_model, one_shot.policy, prompts())  # compacting part-way changed some answer


def test_a_prompt_longer_than_the_pool_runs_within_its_budget_plus_a_chunk(model_dir, hf_model):
    # 64 blocks of 32 tokens: 2,048 tokens of every layer. A 3,000-token prompt at 20% keeps 600 per layer. The pool
    # holds less than max_model_len, so what a request generates is bounded too (decode_every, decode_budget).
    n, chunk, blocks = 3000, 128, 64
    ripplekv = {"method": "snapkv", "retention": 0.2, "prefill_chunk": chunk, "decode_every": 64, "decode_budget": 640}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_list = prompts([n], seed=3)
    with pytest.raises(ValueError, match="max seq len"):  # stock vLLM cannot serve it at all
        with engine(model_dir, None, blocks=blocks, max_model_len=3072, max_num_batched_tokens=chunk):
            pass
    with engine(model_dir, ripplekv, blocks=blocks, max_model_len=3072, max_num_batched_tokens=chunk) as llm:
        engine_ = llm.llm_engine
        engine_.add_request("long", {"prompt_token_ids": token_list[0]},
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        peak, tokens = 0, None
        while engine_.has_unfinished_requests():
            for out in engine_.step():
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)
            peak = max(peak, held_blocks(llm, "long"))
    budget = plan.tier_budget(0, n)
    assert peak > 0 and budget < n and peak <= -(-(budget + chunk + BLOCK) // BLOCK) + 1, (peak, budget)
    assert peak * BLOCK < n  # less than the prompt's own KV: what stock vLLM would hold
    assert tokens == reference(hf_model, plan.policy, token_list, new_tokens=8)[0]


def test_two_engines_in_one_process_stepped_in_turn_keep_their_own_windows(model_dir, hf_model):
    # Each layer of each engine keeps its own requests' window queries: neither engine's steps drop the other's.
    ripplekv = {"method": "snapkv", "retention": 0.2, "prefill_chunk": 64}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = prompts([300, 333], seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    with engine(model_dir, ripplekv, max_num_batched_tokens=48) as first, \
            engine(model_dir, ripplekv, max_num_batched_tokens=48) as second:
        engines = [first.llm_engine, second.llm_engine]
        for engine_, tokens in zip(engines, token_lists):
            engine_.add_request("same-id", {"prompt_token_ids": tokens}, params)
        while any(e.has_unfinished_requests() for e in engines):
            for k, engine_ in enumerate(engines):
                for out in engine_.step() if engine_.has_unfinished_requests() else []:
                    if out.finished:
                        outputs[k] = list(out.outputs[0].token_ids)
    assert [outputs[0], outputs[1]] == reference(hf_model, plan.policy, token_lists, new_tokens=8)


def test_a_pool_holds_what_a_request_can_reach_and_a_short_prompt_generating_to_max_model_len_runs_in_it(
        model_dir, hf_model):
    # Bounded prefill alone bounds a prompt's reading, not its generation: a short prompt (5% of 100 tokens is not
    # more than the window, so it is kept whole) generating up to max_model_len holds all of it. A pool sized by the
    # reading alone admitted such a request and hung the engine (preempted and readmitted forever); it is refused.
    max_len, new = 1024, 900
    prefill_only = {"method": "snapkv", "retention": 0.05, "prefill_chunk": 64}
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=20 cannot hold one sequence of max_model_len=1024 "
                                         r".*needs 33.*unless prefill_chunk bounds its prompt and decode_every with "
                                         r"decode_budget bound what it generates"):
        with engine(model_dir, prefill_only, blocks=20, max_model_len=max_len, max_num_batched_tokens=64):
            pass
    # The same pool given in bytes is refused in the plugin's words (vLLM's own check said "0.0 GiB needed > 0.0 GiB
    # available" for this tiny model), naming the bytes that do hold it; those pass.
    in_bytes = dict(num_gpu_blocks_override=None, max_model_len=max_len, max_num_batched_tokens=64)
    small, enough = kv_cache_bytes(LLAMA_CONFIG, 20, BLOCK, 4), kv_cache_bytes(LLAMA_CONFIG, 33, BLOCK, 4)
    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes={small} \(20 blocks\) cannot hold one sequence of "
                                         rf"max_model_len={max_len} .*needs 33.*give at least {enough} bytes"):
        config(model_dir, prefill_only, kv_cache_memory_bytes=small, **in_bytes)
    config(model_dir, prefill_only, kv_cache_memory_bytes=enough, **in_bytes)
    # With decode_every and decode_budget too, a request holds at most its budget plus a chunk or decode_every tokens
    # and a step: the pool that bound asks for runs the short prompt to max_model_len, and a long one, each equal to
    # the hook.
    bounded = {**prefill_only, "decode_every": 64, "decode_budget": 96}
    plan = plan_for(Settings.from_config(bounded), LAYERS, BLOCK)
    needed = -(-held_tokens_bound(plan, 0, max_len, 64) // BLOCK) + 1  # and vLLM's null block
    assert needed < 33
    with pytest.raises(ValueError, match=rf"num_gpu_blocks_override={needed - 1} cannot hold .*needs {needed}.*"
                                         r"prefill_chunk=64 and decode_every=64 a request holds at most its budget"):
        with engine(model_dir, bounded, blocks=needed - 1, max_model_len=max_len, max_num_batched_tokens=64):
            pass
    short, long = prompts([100, 900], seed=6)
    with engine(model_dir, bounded, blocks=needed, max_model_len=max_len, max_num_batched_tokens=64) as llm:
        assert greedy(llm, [short], new_tokens=new) == reference(hf_model, plan.policy, [short], new_tokens=new)
        assert greedy(llm, [long], new_tokens=8) == reference(hf_model, plan.policy, [long], new_tokens=8)


def test_bounded_prefill_settings_are_refused_by_name(model_dir):
    with pytest.raises(ValueError, match=r"prefill_chunk.*must be a multiple of the block size \(32\), got 80; "
                                         r"e.g. 96"):
        config(model_dir, {"method": "snapkv", "retention": 0.2, "prefill_chunk": 80})
    with pytest.raises(ValueError, match=r"prefill_chunk.*must be an integer > window = 32 .*got 32"):
        config(model_dir, {"method": "snapkv", "retention": 0.2, "prefill_chunk": 32})


# -- blocks ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ripplekv", [None, {"method": "snapkv", "retention": 0.2},
                                      {"method": "pyramidkv", "retention": 0.2, "tiers": 2}],
                         ids=["stock", "snapkv", "pyramidkv-2tiers"])
def test_free_blocks_rise_by_the_dropped_blocks_after_each_prefill(model_dir, ripplekv):
    blocks = 64
    with engine(model_dir, ripplekv, blocks=blocks) as llm:
        pool = scheduler(llm).kv_cache_manager.block_pool
        total = pool.get_num_free_blocks()
        tiers = 1 if ripplekv is None else plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK).num_tiers
        assert total == blocks * tiers - 1  # vLLM keeps one null block
        engine_ = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        held = 0
        # 300 and 333 tokens: neither a multiple of the block size, so the first new token needs no new block.
        for i, tokens in enumerate(prompts([300, 333])):
            n = len(tokens)
            engine_.add_request(f"r{i}", {"prompt_token_ids": tokens}, params)
            engine_.step()  # the whole prompt (one chunk) and its first token
            prompt_blocks = tiers * -(-n // BLOCK)
            assert pool.get_num_free_blocks() == total - held - prompt_blocks
            engine_.step()  # the scheduler frees what the prefill's compaction emptied, before the next token
            dropped = 0
            if ripplekv is not None:
                plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
                dropped = sum(plan.dropped_blocks(t, n) for t in range(tiers))
                assert dropped > 0
            assert pool.get_num_free_blocks() == total - held - prompt_blocks + dropped
            held += prompt_blocks - dropped
        if ripplekv is not None:
            # A prompt that grows after its compression (a streaming-input session) is refused.
            manager = scheduler(llm).kv_cache_manager.coordinator.single_type_managers[0]
            first = next(r.request_id for r in scheduler(llm).running if r.num_prompt_tokens == 300)
            with pytest.raises(RuntimeError, match="prompt grew from 300 to 310 tokens .* streaming-input"):
                manager.remove_skipped_blocks(first, 320, 310)
        while engine_.has_unfinished_requests():
            engine_.step()
        assert pool.get_num_free_blocks() == total


# -- the version guard and the refusals -------------------------------------------------------------------------------

def test_version_guard(model_dir, tmp_path):
    assert plugin.SUPPORTED_VLLM == "0.32.0"
    plugin.check_vllm_version()  # the release this environment pins
    code = f"""
import vllm
vllm.__version__ = "0.31.0"
from vllm.engine.arg_utils import EngineArgs
kwargs = dict(model={model_dir!r}, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=1024, enable_prefix_caching=False)
EngineArgs(**kwargs).create_engine_config()   # loads the plugins; no compression asked for: stock vLLM
asked = {{"ripplekv": {{"method": "snapkv", "retention": 0.2}}}}
try:
    EngineArgs(**kwargs, additional_config=asked).create_engine_config()
except RuntimeError as e:
    print("REFUSED", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("REFUSED")]
    assert line and "vLLM 0.32.0" in line[0] and "vLLM 0.31.0 is installed" in line[0]


@pytest.mark.parametrize("overrides,message", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
     "speculative decoding"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
    (dict(block_size=16), "CPU attention kernel 'vec16'"),
    (dict(tensor_parallel_size=4), r"tensor_parallel_size=4 above the model's 2 KV heads .*use a "
                                   r"tensor_parallel_size that divides 2"),
    (dict(pipeline_parallel_size=2, enforce_eager=True), r"pipeline_parallel_size=2 with enforce_eager=True .*drop "
                                                         r"enforce_eager"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), r"distributed_executor_backend='uni'.*use "
                                                                       r"distributed_executor_backend='mp'"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=0, pipeline_parallel_size=2, enforce_eager=False),
     r"nnodes=2 with 4 workers is not supported; across machines the plugin is tested on two nodes with one worker "
     r"each"),
], ids=["speculative", "fp8-cache", "block-size-16", "replicated-kv-heads", "pipeline-eager", "executor",
        "nodes-untested"])
def test_refusals_by_name(model_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(model_dir, **overrides)


def test_tiers_must_spread_over_the_pipeline_stages(model_dir, profile_path):
    # PyramidKV's 2 tiers are layers [0, 1] and [2, 3]: one per stage of 2. RippleKV's profile puts the most sensitive
    # layers 0 and 2 in one tier, one on each stage: accepted.
    parallel = dict(pipeline_parallel_size=2, enforce_eager=False, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match=r"tiers=2 with pipeline_parallel_size=2 when the tiers \[\[0, 1\], \[2, 3\]\] "
                                         r"do not put as many layers of each tier on every stage .*one of \[1\]"):
        config(model_dir, {"method": "pyramidkv", "retention": 0.2, "tiers": 2}, **parallel)
    config(model_dir, {"method": "ripplekv", "retention": 0.2, "tiers": 2, "profile": profile_path}, **parallel)


def test_the_v2_model_runner_is_refused_by_name(model_dir, monkeypatch):
    # The plugin hooks the V1 runner's attention metadata: under the V2 runner its scheduler would free blocks that
    # attention still reads.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match=r"V2 model runner .*unset VLLM_USE_V2_MODEL_RUNNER"):
        config(model_dir)


@pytest.mark.parametrize("ripplekv,message", [
    ({"method": "cake", "retention": 0.2}, r"method\"\] cake cannot run in the engine, CakeAllocator.*: its budgets "
                                           r"come from the prompt's attention over every layer"),
    ({"method": "uniform+adakv", "retention": 0.2}, r"uniform\+adakv cannot run in the engine, AdaKVSelector.*: its "
                                                    r"heads keep different counts"),
    ({"method": "full", "retention": 0.2}, r"full compresses nothing: drop additional_config"),
    ({"method": "snapkv2", "retention": 0.2}, r"method\"\]: unknown method 'snapkv2': expected one of full, "),
    ({"method": "snapkv", "retention": 0.2, "budget": 64}, r"unknown keys \['budget'\]"),
    ({"method": "snapkv"}, "must give \"method\" .* and \"retention\""),
    ({"method": "snapkv", "retention": 1.5}, r"retention.*must be a number in \(0, 1\]"),
    ({"method": "pyramidkv", "retention": 0.2, "tiers": 3}, r"tiers.*must divide the model's 4 layers"),
    ({"method": "ripplekv", "retention": 0.2}, r"profile.*must be the path of a RippleKV profile"),
    ({"method": "ripplekv", "retention": 0.2, "profile": "/nonexistent/profile.json"}, "not found"),
    ({"method": "snapkv", "retention": 0.2, "profile": "x.json"}, "only read by RippleKV's budgets, not snapkv"),
    ({"method": "snapkv", "retention": 0.2, "protect_prefix": -32}, r"protect_prefix\"\] must be an integer >= 0"),
    ({"method": "snapkv", "retention": 0.2, "protect_prefix": 48}, r"protect_prefix\"\] must be a multiple of the "
                                                                   r"block size \(32\), got 48; e.g. 32"),
    ({"method": "snapkv", "retention": 0.2, "compress_prefix": 1.5}, r"compress_prefix\"\] must be an integer >= 0"),
    ({"method": "snapkv", "retention": 0.2, "compress_prefix": 100}, r"compress_prefix\"\] must be a multiple of "
                                                                     r"the block size \(32\), got 100; e.g. 96"),
    ({"method": "snapkv", "retention": 0.2, "compress_prefix": 256, "protect_prefix": 256},
     r"compress_prefix\"\] compresses each prompt once, at its prefix, .* cannot run with \['protect_prefix'\]"),
    ({"method": "snapkv", "retention": 0.2, "compress_prefix": 256, "prefill_chunk": 128, "decode_every": 32},
     r"cannot run with \['prefill_chunk', 'decode_every'\]; drop them or compress_prefix"),
    ({"method": "snapkv", "retention": 0.9, "compress_prefix": 64}, r"compress_prefix\"\] 64 keeps every block of "
                                                                    r"the prefix at retention 0.9"),
], ids=["cake", "adakv", "full", "unknown-method", "unknown-key", "no-retention", "retention", "tiers",
        "no-profile", "missing-profile", "stray-profile", "negative-protect", "protect-not-whole-blocks",
        "fractional-compress-prefix", "compress-prefix-not-whole-blocks", "compress-and-protect",
        "compress-and-chunks", "compress-prefix-keeping-all"])
def test_bad_settings_are_refused(model_dir, ripplekv, message):
    with pytest.raises(ValueError, match=message):
        config(model_dir, ripplekv)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_the_engine_takes_each_sample_method_the_policy_can_select_again_and_refuses_the_rest(model_dir, profile_path,
                                                                                           name):
    # The tests' table of sample policies, by method name: the engine runs what the policy can select after each
    # chunk of a prompt, with the policy's own selector, and refuses the rest in the policy's words.
    policy = sample_policies(LAYERS)[name]
    method, protect = sample_method(name)
    ripplekv = {"method": method, "retention": 0.3, "protect_prefix": protect,
                **({"profile": profile_path} if "ripplekv" in name else {})}
    refusal = policy.reselection_refusal()
    if refusal is not None:
        with pytest.raises(ValueError, match=rf"{re.escape(method)} cannot run in the engine, .*"
                                             rf"{re.escape(refusal[1])}"):
            config(model_dir, ripplekv)
        return
    config(model_dir, ripplekv)
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    assert repr(plan.policy.selector) == repr(policy.selector)
    assert type(plan.policy.allocator.base.base) is type(policy.allocator)  # block-aligned tiers of the same budgets
    assert plan.policy.protect == policy.protect


def test_a_profile_with_a_nan_names_the_file_and_the_field(model_dir, profile_path, tmp_path):
    data = json.loads(open(profile_path).read())
    data["sensitivity"][2] = float("nan")
    bad = tmp_path / "nan.json"
    bad.write_text(json.dumps(data))  # written as NaN, which JSON does not have
    with pytest.raises(ValueError, match=r"nan.json: profile field sensitivity\[2\]: expected a finite number"):
        config(model_dir, {"method": "ripplekv", "retention": 0.2, "profile": str(bad)})


def test_bfloat16_on_a_cpu_with_amx_names_the_dtype(model_dir, monkeypatch):
    from ripplekv_ext.engines.vllm.worker import attention

    monkeypatch.setattr(attention, "cpu_isa", lambda *args: "amx")  # what vLLM picks for bf16 on AMX CPUs
    with pytest.raises(ValueError, match=r"dtype torch.bfloat16 on this CPU: vLLM runs its AMX attention kernel .*"
                                         r"use dtype='float16' or 'float32'"):
        config(model_dir, dtype="bfloat16")


def test_tiers_without_their_blocks_are_refused_by_name(model_dir):
    ripplekv = {"method": "pyramidkv", "retention": 0.2, "tiers": 2}
    kwargs = engine_kwargs(model_dir, ripplekv)
    kwargs["num_gpu_blocks_override"] = 40  # a stock engine's 64 blocks would hold max_model_len (1024) once
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=40 cannot hold one sequence of max_model_len=1024 "
                                         r"in each of the engine's 2 tiers \(needs 65 .*multiply the blocks"):
        EngineArgs(**kwargs).create_engine_config()


def test_profile_of_another_model_is_refused(model_dir, profile_path, tmp_path):
    data = json.loads(open(profile_path).read())
    data["model"]["head_dim"] = 64
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="profile is for another model: model.head_dim expected 64"):
        config(model_dir, {"method": "ripplekv", "retention": 0.2, "profile": str(other)})


class _Override:
    """``obj`` with some attributes replaced (``checks.validate`` reads configs by attribute)."""

    def __init__(self, obj, **values):
        self._obj, self._values = obj, values

    def __getattr__(self, name):
        return self._values[name] if name in self._values else getattr(self._obj, name)


@pytest.mark.parametrize("part,values,message", [
    ("scheduler_config", {"async_scheduling": True}, "async scheduling"),
    ("model_config", {"use_mla": True}, "MLA attention"),
    ("model_config", {"is_encoder_decoder": True}, "encoder-decoder"),
    ("model_config", {"is_multimodal_model": True}, "multimodal"),
    ("model_config", {"runner_type": "pooling"}, "runner 'pooling'"),
    (None, {"kv_transfer_config": object()}, "KV transfer connectors"),
], ids=["async-scheduling", "mla", "encoder-decoder", "multimodal", "pooling", "kv-connector"])
def test_refusals_of_settings_this_cpu_build_cannot_reach(model_dir, part, values, message):
    # The CPU platform turns async scheduling off itself and the tiny model has none of these properties: the
    # checks run on the real config with one attribute changed.
    real = config(model_dir)
    fake = _Override(real, **values) if part is None else _Override(real, **{part: _Override(getattr(real, part),
                                                                                            **values)})
    with pytest.raises(checks.UnsupportedConfigError, match=message):
        checks.validate(fake)


def test_sliding_window_settings_and_other_platforms_are_refused(model_dir, monkeypatch):
    real = config(model_dir)
    text = real.model_config.hf_text_config
    monkeypatch.setattr(text, "layer_types", ["sliding_attention"] * 4, raising=False)
    with pytest.raises(checks.UnsupportedConfigError, match="a model without full-attention layers"):
        checks.validate(real)
    monkeypatch.setattr(text, "layer_types", ["full_attention", "sliding_attention"] * 2, raising=False)
    checks.validate(real)  # a hybrid model: its full-attention layers are compressed
    monkeypatch.setattr(real.scheduler_config, "disable_hybrid_kv_cache_manager", True)
    with pytest.raises(checks.UnsupportedConfigError, match=r"disable_hybrid_kv_cache_manager with a model of "
                                                            r"sliding-window layers \(2 of 4 here\)"):
        checks.validate(real)
    monkeypatch.undo()
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(checks.UnsupportedConfigError, match="platform"):
        checks.validate(real)
