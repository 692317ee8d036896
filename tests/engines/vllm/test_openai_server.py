"""The documented serving command, run as a user runs it: vLLM's OpenAI-compatible server
(``python -m vllm.entrypoints.openai.api_server``, docs/vllm.md) with the plugin, on a loopback port, answering
completion and chat requests sent over HTTP at once; every answer equals the offline ``LLM`` path's with the same
settings. The model is the tiny random Llama with a word-level tokenizer (``w3 w4 ...``) and a chat template."""

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from vllm import SamplingParams  # noqa: E402

from tiny_llama import LLAMA_CONFIG, load_reference_model, save_tiny_llama  # noqa: E402
from harness import BLOCK, LAYERS, free_port, prompts, reference_compressed_prefix, running, stop  # noqa: E402
from ripplekv_ext.engines.vllm.settings import Settings  # noqa: E402
from ripplekv_ext.engines.vllm.plan import plan_for  # noqa: E402
from ripplekv_ext.engines.vllm.sizing import kv_cache_bytes  # noqa: E402

# The system prompt of the chats below is 200 tokens: its first 192 (6 blocks) are compressed once and shared.
RIPPLEKV = {"method": "snapkv", "retention": 0.4, "compress_prefix": 192}
PREFIX = RIPPLEKV["compress_prefix"]
NEW_TOKENS = 16
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
SERVER_START_S = 300


@pytest.fixture(scope="module")
def model_with_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tokenizer"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, LLAMA_CONFIG["vocab_size"])}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def engine_arguments(model):
    """The settings both paths share, as ``LLM`` keyword arguments."""
    return dict(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=1024,
                kv_cache_memory_bytes=kv_cache_bytes(LLAMA_CONFIG, 64, BLOCK, 4), max_num_seqs=8,
                additional_config={"ripplekv": RIPPLEKV})


def command_line(model, port):
    args = engine_arguments(model)
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", args["dtype"], "--enforce-eager", "--block-size", str(BLOCK),
            "--max-model-len", str(args["max_model_len"]),
            "--kv-cache-memory-bytes", str(args["kv_cache_memory_bytes"]),
            "--max-num-seqs", str(args["max_num_seqs"]), "--additional-config", json.dumps(args["additional_config"])]


def texts():
    return [" ".join(f"w{t}" for t in tokens) for tokens in prompts([60, 270, 300, 333], seed=4)]


def post(port, route, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(model_with_tokenizer, tmp_path_factory):
    port = free_port()
    folder = tmp_path_factory.mktemp("server")
    log = folder / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with open(log, "w") as out:
        # Outside the checkout: `python -m` puts the working folder first on sys.path, and the checkout's
        # ripplekv_ext (no compiled library) would shadow the installed package: vLLM would log that the plugin
        # failed to load and serve stock.
        process = subprocess.Popen(command_line(model_with_tokenizer, port), stdout=out, stderr=subprocess.STDOUT,
                                   env=env, cwd=folder)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer in {SERVER_START_S} s:\n{log.read_text()[-4000:]}")
                time.sleep(1)
        yield port, log
    finally:
        stop(process, 60)


def offline_answers(model, ripplekv=True):
    """The offline path's completions and chat answers (text), greedy; ``ripplekv=False``: stock vLLM."""
    arguments = engine_arguments(model)
    if not ripplekv:
        del arguments["additional_config"]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with running(**arguments) as llm:
        completions = [o.outputs[0].text for o in llm.generate(texts(), params, use_tqdm=False)]
        chats = [llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0].outputs[0].text
                 for text in texts()]
    return completions, chats


@pytest.fixture(scope="module")
def offline(model_with_tokenizer):
    return offline_answers(model_with_tokenizer)


def test_the_openai_server_answers_as_the_offline_engine(server, offline, model_with_tokenizer):
    server, log = server
    completions, chats = offline
    body = dict(model=model_with_tokenizer, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        completion_answers = pool.map(lambda text: post(server, "/v1/completions", {**body, "prompt": text}),
                                      texts())
        chat_answers = pool.map(lambda text: post(server, "/v1/chat/completions", {
            **body, "messages": [{"role": "user", "content": text}]}), texts())
        served_completions = [a["choices"][0]["text"] for a in completion_answers]
        served_chats = [a["choices"][0]["message"]["content"] for a in chat_answers]
    assert served_completions == completions
    assert served_chats == chats
    # The plugin compressed them: stock vLLM answers some long prompt otherwise.
    stock_completions, _ = offline_answers(model_with_tokenizer, ripplekv=False)
    assert stock_completions != completions
    assert "Failed to load plugin" not in log.read_text()


SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}


def _ids(text):
    """The word-level tokenizer's ids of a text (``w5 w6`` -> ``[5, 6]``, its special words too)."""
    return [SPECIAL[word] if word in SPECIAL else int(word[1:]) for word in text.split()]


def test_chats_sharing_a_system_prompt_answer_as_the_hook(server, model_with_tokenizer):
    """Four chats of two turns at once over HTTP, prefix caching on (the server's default), every one after the same
    system prompt, whose first 192 tokens are compressed once: the second turns resend the first with its answer, so
    they read the compressed prefix, their first turn's prompt and its answer from the cache. Each answer equals the
    prefix compressed alone by its tail (``compress_context``), then the rest of its prompt (``continue_context``)."""
    server, _ = server
    system, *users = (" ".join(f"w{t}" for t in tokens) for tokens in prompts([200, 40, 60, 50, 70, 30, 45, 55, 35],
                                                                                 seed=9))
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": users[i]}] for i in range(4)]
    body = dict(model=model_with_tokenizer, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                skip_special_tokens=False)  # every generated token in the answer's words, special ones too

    def ask(messages):
        return post(server, "/v1/chat/completions", {**body, "messages": messages})["choices"][0]["message"]["content"]

    turns = []
    for turn in range(2):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, chats))
        turns += [(chat, answer) for chat, answer in zip(chats, answers)]
        chats = [chat + [{"role": "assistant", "content": answer}, {"role": "user", "content": users[4 + i]}]
                 for i, (chat, answer) in enumerate(zip(chats, answers))]
    # The chat template joins the messages' words: the prompt's ids are theirs in order.
    prompts_ids = [[t for message in chat for t in _ids(message["content"])] for chat, _ in turns]
    plan = plan_for(Settings.from_config(RIPPLEKV), LAYERS, BLOCK)
    assert all(plan.compacts_prefix(len(ids)) for ids in prompts_ids)
    expected = reference_compressed_prefix(load_reference_model(model_with_tokenizer), plan.policy, PREFIX, prompts_ids,
                                           new_tokens=NEW_TOKENS)
    assert [_ids(answer) for _, answer in turns] == expected
