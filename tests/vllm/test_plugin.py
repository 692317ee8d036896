"""The vLLM plugin on a tiny random Llama (4 layers, head size 32, float32), engines running in this process.

What is checked: the plugin loads through its entry point and runs stock vLLM unless asked; with budgets covering
the prompt its tokens equal stock vLLM's; compressed, each request's tokens equal ``ripplekv_ext.compress`` with the
engine's own (block-aligned, tiered) policy + transformers ``generate`` on that prompt alone, through chunked
prefills and preemption; blocks go back to the pool after each prefill and on finish; the version guard and every
refusal.
"""

import contextlib
import gc
import json
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not this folder, which imports as a namespace package "vllm"

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed import cleanup_dist_env_and_memory  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

import ripplekv_ext  # noqa: E402
from ripplekv_ext.engines import vllm as plugin  # noqa: E402
from ripplekv_ext.engines.vllm import checks  # noqa: E402
from ripplekv_ext.engines.vllm.attention import RippleKVCPUImpl  # noqa: E402
from ripplekv_ext.engines.vllm.settings import (BlockAlignedAllocator, Settings, aligned_budget,  # noqa: E402
                                                plan_for)
from ripplekv_ext.policies import PromptTooShortWarning  # noqa: E402

torch.set_num_threads(1)

BLOCK = 32
LAYERS = 4
VOCAB = 512
# A prompt shorter than the window (never compressed), lengths that are not multiples of the block size, and ones
# long enough to drop several blocks at 20%.
PROMPT_LENGTHS = [20, 100, 270, 300, 333]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # initializer_range 0.1: peaked enough attention that dropping tokens changes greedy tokens.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.1)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def profile_path(hf_model, tmp_path_factory):
    """A RippleKV profile of the tiny model with unequal sensitivities (made up: the mechanics are under test)."""
    from ripplekv_ext.profile_file import Profile, describe_model, save_profile

    sensitivity = [0.5, 0.05, 0.2, 0.01]
    profile = Profile(model=describe_model(hf_model, "tiny-llama"),
                      method={"target": "values", "sigma": 1.0, "seed": 0, "draws": 1, "metric": "kl"},
                      calibration={"source": "synthetic", "num_examples": 1, "prefix_len": 64, "cont_len": 8},
                      layers=list(range(LAYERS)), sensitivity=sensitivity, stderr=[0.0] * LAYERS,
                      per_example=[sensitivity], compressible_layers=list(range(LAYERS)),
                      stability={"split_half_spearman": None, "until_stable": False},
                      cost={"seconds": 0.0, "tokens_processed": 0, "device": "cpu"})
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    save_profile(profile, path)
    return str(path)


def prompts(lengths=PROMPT_LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def engine_kwargs(model_dir, ripplekv=None, blocks=64, **overrides):
    """Stock vLLM (``ripplekv=None``) or the plugin; ``blocks``: KV blocks of a stock engine, multiplied by the
    number of tiers for the plugin (a tier's block holds ``1 / T`` of a stock block's layers): the same memory."""
    tiers = 1
    if ripplekv is not None:
        tiers = plan_for(Settings.from_config(ripplekv), LAYERS, overrides.get("block_size", BLOCK)).num_tiers
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=BLOCK,
                  num_gpu_blocks_override=blocks * tiers, max_model_len=1024, gpu_memory_utilization=0.05,
                  enable_prefix_caching=False, max_num_seqs=8)
    if ripplekv is not None:
        kwargs["additional_config"] = {"ripplekv": ripplekv}
    kwargs.update(overrides)
    return kwargs


@contextlib.contextmanager
def engine(model_dir, ripplekv=None, blocks=64, **overrides):
    llm = LLM(**engine_kwargs(model_dir, ripplekv, blocks, **overrides))
    try:
        yield llm
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def greedy(llm, token_lists, new_tokens=NEW_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": t} for t in token_lists], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def reference(hf_model, policy, token_lists, new_tokens=NEW_TOKENS):
    """Each prompt alone through transformers' ``generate`` under ``ripplekv_ext.compress(model, policy)``."""
    out = []
    for tokens in token_lists:
        ids = torch.tensor([tokens])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PromptTooShortWarning)
            with torch.no_grad(), ripplekv_ext.compress(hf_model, policy):
                generated = hf_model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        out.append(generated[0, len(tokens):].tolist())
    return out


@pytest.fixture(scope="module")
def stock_tokens(model_dir):
    with engine(model_dir) as llm:
        return greedy(llm, prompts())


# -- loading ----------------------------------------------------------------------------------------------------------

def test_entry_point_registers_the_plugin():
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("ripplekv") == "ripplekv_ext.engines.vllm:register"


def test_plugin_is_loaded_by_vllm_and_stock_engines_stay_stock(model_dir, stock_tokens):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    # vLLM loaded the plugin through the entry point when it built the stock engine (stock_tokens).
    assert AttentionBackendEnum.CPU_ATTN.get_path() == "ripplekv_ext.engines.vllm.attention.RippleKVCPUBackend"
    with engine(model_dir) as llm:
        managers = scheduler(llm).kv_cache_manager.coordinator.single_type_managers
        assert [type(m) for m in managers] == [FullAttentionManager]
        assert greedy(llm, prompts()[:2]) == stock_tokens[:2]


def test_import_ripplekv_ext_does_not_import_vllm(tmp_path):
    code = "import sys, ripplekv_ext, ripplekv_ext.engines; print('vllm' in sys.modules)"
    # Outside the checkout: its ripplekv_ext folder (no compiled library) would shadow the installed package.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "False"


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


def test_preempted_requests_recompute_to_the_same_tokens(model_dir, hf_model, monkeypatch):
    ripplekv = {"method": "snapkv", "retention": 0.2}
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


def config(model_dir, ripplekv=None, **overrides):
    ripplekv = {"method": "snapkv", "retention": 0.2} if ripplekv is None else ripplekv
    return EngineArgs(**engine_kwargs(model_dir, ripplekv, **overrides)).create_engine_config()


@pytest.mark.parametrize("overrides,message", [
    (dict(enable_prefix_caching=True), "prefix caching .* enable_prefix_caching=False"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
     "speculative decoding"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
    (dict(block_size=16), "CPU attention kernel 'vec16'"),
], ids=["prefix-caching", "speculative", "fp8-cache", "tensor-parallel", "pipeline-parallel", "block-size-16"])
def test_refusals_by_name(model_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        config(model_dir, **overrides)


def test_prefix_caching_is_refused_by_default(model_dir):
    kwargs = engine_kwargs(model_dir, {"method": "snapkv", "retention": 0.2})
    del kwargs["enable_prefix_caching"]  # vLLM turns it on by default
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs(**kwargs).create_engine_config()


@pytest.mark.parametrize("ripplekv,message", [
    ({"method": "h2o", "retention": 0.2}, r"method.*must be one of .*got 'h2o'"),
    ({"method": "snapkv", "retention": 0.2, "budget": 64}, r"unknown keys \['budget'\]"),
    ({"method": "snapkv"}, "must give \"method\" .* and \"retention\""),
    ({"method": "snapkv", "retention": 1.5}, r"retention.*must be a number in \(0, 1\]"),
    ({"method": "pyramidkv", "retention": 0.2, "tiers": 3}, r"tiers.*must divide the model's 4 layers"),
    ({"method": "ripplekv", "retention": 0.2}, r"profile.*must be the path of a RippleKV profile"),
    ({"method": "ripplekv", "retention": 0.2, "profile": "/nonexistent/profile.json"}, "not found"),
    ({"method": "snapkv", "retention": 0.2, "profile": "x.json"}, "only read by method ripplekv"),
], ids=["h2o", "unknown-key", "no-retention", "retention", "tiers", "no-profile", "missing-profile", "stray-profile"])
def test_bad_settings_are_refused(model_dir, ripplekv, message):
    with pytest.raises(ValueError, match=message):
        config(model_dir, ripplekv)


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


def test_sliding_window_models_and_other_platforms_are_refused(model_dir, monkeypatch):
    real = config(model_dir)
    text = real.model_config.hf_text_config
    monkeypatch.setattr(text, "layer_types", ["full_attention", "sliding_attention"] * 2, raising=False)
    with pytest.raises(checks.UnsupportedConfigError, match=r"sliding-window layers \(2 of 4 here\)"):
        checks.validate(real)
    monkeypatch.undo()
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(checks.UnsupportedConfigError, match="platform"):
        checks.validate(real)


# -- the budget rule --------------------------------------------------------------------------------------------------

def test_block_aligned_budgets_drop_whole_blocks():
    for n in range(1, 700, 7):
        for budget in (33, 40, 64, 65, 100, 300):
            kept = aligned_budget(budget, n, BLOCK)
            if budget >= n:
                assert kept == n
            else:
                assert budget <= kept < budget + BLOCK and (n - kept) % BLOCK == 0 and kept <= n
    base = ripplekv_ext.PyramidKVAllocator()
    aligned = BlockAlignedAllocator(base, BLOCK)
    assert aligned.budgets(LAYERS, 1000, 200, 32) == [aligned_budget(b, 1000, BLOCK)
                                                      for b in base.budgets(LAYERS, 1000, 200, 32)]


def test_plan_tiers_and_blocks(profile_path):
    plan = plan_for(Settings.from_config({"method": "ripplekv", "retention": 0.2, "tiers": 2,
                                          "profile": profile_path}), LAYERS, BLOCK)
    assert plan.tiers == [[0, 2], [1, 3]]  # the most sensitive layers (0 and 2) share the larger budget
    n = 1000
    budgets = plan.compressor.budgets(n)
    assert budgets[0] == budgets[2] > budgets[1] == budgets[3]
    for t in range(2):
        assert plan.dropped_blocks(t, n) == (n - plan.tier_budget(t, n)) // BLOCK
        assert (n - plan.tier_budget(t, n)) % BLOCK == 0
    assert plan.blocks_held(n) == sum(-(-plan.tier_budget(t, n) // BLOCK) for t in range(2))
