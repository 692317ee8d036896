"""Engines of the plugin and their single-request reference, shared by the plugin's tests (imported after vLLM is
known to be installed)."""

import contextlib
import gc
import socket
import subprocess
import warnings

import torch
from vllm import LLM, SamplingParams
from vllm.distributed import cleanup_dist_env_and_memory
from vllm.engine.arg_utils import EngineArgs

import ripplekv_ext
from ripplekv_ext.engines.vllm.settings import Settings
from ripplekv_ext.engines.vllm.plan import plan_for
from ripplekv_ext.engines.vllm.sizing import kv_cache_bytes
from ripplekv_ext.policies import PromptTooShortWarning

from tiny_llama import LLAMA_CONFIG

BLOCK = 32
LAYERS = LLAMA_CONFIG["num_hidden_layers"]
VOCAB = LLAMA_CONFIG["vocab_size"]
# A prompt shorter than the window (never compressed), lengths that are not multiples of the block size, and ones
# long enough to drop several blocks at 20%.
PROMPT_LENGTHS = [20, 100, 270, 300, 333]
NEW_TOKENS = 24


def prompts(lengths=PROMPT_LENGTHS, seed=0, vocab=VOCAB):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def engine_kwargs(model_dir, ripplekv=None, blocks=64, model_config=LLAMA_CONFIG, **overrides):
    """Stock vLLM (``ripplekv=None``) or the plugin; ``blocks``: KV blocks of a stock engine, multiplied by the
    number of tiers for the plugin (a tier's block holds ``1 / T`` of a stock block's layers): the same memory, given
    in bytes per worker so that nothing depends on the machine's memory (a memory fraction is taken of the NUMA
    node's). ``tensor_parallel_size`` / ``pipeline_parallel_size`` run vLLM's multiprocess executor."""
    tiers = 1
    block_size = overrides.get("block_size", BLOCK)
    if ripplekv is not None:
        tiers = plan_for(Settings.from_config(ripplekv), model_config["num_hidden_layers"], block_size).num_tiers
    tp = overrides.get("tensor_parallel_size", 1)
    pp = overrides.get("pipeline_parallel_size", 1)
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=BLOCK,
                  num_gpu_blocks_override=blocks * tiers, max_model_len=1024,
                  kv_cache_memory_bytes=kv_cache_bytes(model_config, blocks, block_size, 4, tp, pp),
                  enable_prefix_caching=False, max_num_seqs=8)
    if tp * pp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if ripplekv is not None:
        kwargs["additional_config"] = {"ripplekv": ripplekv}
    kwargs.update(overrides)
    return kwargs


@contextlib.contextmanager
def running(**llm_kwargs):
    """An ``LLM`` of these arguments, shut down (its workers too) on exit."""
    llm = LLM(**llm_kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def engine(model_dir, ripplekv=None, blocks=64, **overrides):
    """``running`` the engine of ``engine_kwargs``."""
    return running(**engine_kwargs(model_dir, ripplekv, blocks, **overrides))


def config(model_dir, ripplekv=None, **overrides):
    """The engine config vLLM builds (the plugin's checks run in it)."""
    ripplekv = {"method": "snapkv", "retention": 0.2} if ripplekv is None else ripplekv
    return EngineArgs(**engine_kwargs(model_dir, ripplekv, **overrides)).create_engine_config()


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


def reference_compressed_prefix(hf_model, policy, prefix, token_lists, new_tokens=NEW_TOKENS):
    """``compress_prefix``'s reference: a prompt longer than ``prefix`` has its first ``prefix`` tokens compressed
    alone, scored by their own last ``W`` tokens (``compress_context(..., scoring="tail")``), then the rest read
    whole and the answer generated (``continue_context``); a shorter prompt as ``reference``."""
    out = []
    for tokens in token_lists:
        if len(tokens) <= prefix:
            out += reference(hf_model, policy, [tokens], new_tokens)
            continue
        ids = torch.tensor([tokens])
        cache = ripplekv_ext.compress_context(hf_model, ids[:, :prefix], policy, scoring="tail")
        generated = ripplekv_ext.continue_context(hf_model, cache, ids[:, prefix:], max_new_tokens=new_tokens,
                                                  do_sample=False)
        out.append(generated[0, len(tokens):].tolist())
    return out


def held_blocks(llm, request_id):
    """Blocks (every tier) a request holds in the scheduler's pool: its block tables' entries that are not the null
    block. vLLM's engine adds a suffix to the id a request was given (``"0"`` runs as ``"0-a5ae4e72"``)."""
    managers = scheduler(llm).kv_cache_manager.coordinator.single_type_managers
    ids = {key for m in managers for key in m.req_to_blocks if key == request_id or key.startswith(f"{request_id}-")}
    if len(ids) > 1:
        raise ValueError(f"request id {request_id!r} matches {sorted(ids)}")
    return sum(sum(1 for block in m.req_to_blocks.get(key, ()) if not block.is_null) for m in managers for key in ids)


def shared_prefix_prompts(vocab=VOCAB):
    """A 320-token document asked five ways: four questions of 40-90 tokens after it, and its first 200 tokens
    alone (a request whose own first compaction's window lies inside what others cached)."""
    document = prompts([320], seed=7, vocab=vocab)[0]
    questions = prompts([40, 64, 90, 50], seed=8, vocab=vocab)
    return [document + q for q in questions] + [document[:200]]


def step_and_collect(engine_, tokens: dict, cached: dict) -> None:
    """One engine step; each request it finishes: its generated tokens and cached prompt tokens, by request id."""
    for out in engine_.step():
        if out.finished:
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            cached[out.request_id] = out.num_cached_tokens


def run_first_then_rest(llm, token_lists, first_alone=True, new_tokens=NEW_TOKENS):
    """Tokens and cached prompt tokens per request: the first request runs alone (its blocks enter the cache), then
    the others together."""
    engine_ = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    tokens, cached = {}, {}
    batches = [token_lists[:1], token_lists[1:]] if first_alone else [token_lists]
    offset = 0
    for batch in batches:
        for i, t in enumerate(batch):
            engine_.add_request(str(offset + i), {"prompt_token_ids": t}, params)
        offset += len(batch)
        while engine_.has_unfinished_requests():
            step_and_collect(engine_, tokens, cached)
    order = [str(i) for i in range(len(token_lists))]
    return [tokens[k] for k in order], [cached[k] for k in order]


def run_shared_document(model_dir, ripplekv, pools):
    """``run_first_then_rest`` of ``shared_prefix_prompts`` on an engine with prefix caching, 128 tokens a step:
    (the plan, the prompts, their tokens, their cached prompt tokens). ``pools`` gets the scheduler's block pool (the
    write guard's, ``writes_to_shared_blocks``); the pool must be whole again at the end."""
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=128) as llm:
        pool = scheduler(llm).kv_cache_manager.block_pool
        pools.append(pool)
        tokens, cached = run_first_then_rest(llm, token_lists)
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    return plan, token_lists, tokens, cached


def preempt_abort_and_go_on(llm, token_lists):
    """Outputs and cached prompt tokens by request id (``"0"``, ``"1"``, ``"3"``) of four prompts: the first two
    decode a few steps and are preempted (vLLM's reset_prefix_cache with running requests, which also empties the
    cache), then recompute prompt and output in one step each; the third (``"aborted"``) is aborted in the step after
    its admission; the fourth runs to the end with the first two. The pool must be whole again at the end."""
    engine_ = llm.llm_engine
    sched = scheduler(llm)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs, cached = {}, {}

    def step():
        step_and_collect(engine_, outputs, cached)

    for i in (0, 1):
        engine_.add_request(str(i), {"prompt_token_ids": token_lists[i]}, params)
    for _ in range(4):
        step()
    assert len(sched.running) == 2 and all(r.num_output_tokens > 1 for r in sched.running)
    assert llm.reset_prefix_cache(reset_running_requests=True)
    step()  # both resume: prompt and output recomputed in one step each
    engine_.add_request("aborted", {"prompt_token_ids": token_lists[2]}, params)
    step()
    engine_.abort_request(["aborted"])
    engine_.add_request("3", {"prompt_token_ids": token_lists[3]}, params)
    while engine_.has_unfinished_requests():
        step()
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    return outputs, cached


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen, seconds: float) -> None:
    """Terminate a server or node process, killed if it is still running after ``seconds``."""
    process.terminate()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
