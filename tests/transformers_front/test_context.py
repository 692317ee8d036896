"""Compress once, ask many (ripplekv_ext.transformers_front.context): checked against compress() on the same prefill,
the stock model, the independent masked computation of test_hook (answers after a compressed context), each row alone
(batches) and the reference ops (probe windows); a used, a saved and a too-short context. The evaluation protocols built
on it (the question inside or after the compressed context: ripplekv_ext.eval.runner and grid) are tested here too."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import ripplekv_ref
from ripplekv_ext import Policy, compress, compress_context, continue_context
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.model_info import compressible_layers

pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402

from ripplekv_ext.transformers_front.context import DEFAULT_PROBE, load_context  # noqa: E402
from ripplekv_ext.integrations.transformers import cache_argument, output_cache  # noqa: E402
from test_hook import MaskedReference  # noqa: E402  (the independent oracle of compressed attention)

CACHE = cache_argument()
WINDOW = 8
GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)


def _ids(batch=1, n=96, seed=0):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def toy_sensitivity(num_layers):
    return [1.0 + ((7 * i) % 5) * 0.4 for i in range(num_layers)]


def _answer(model, cache, question, steps=4, **kwargs):
    out = continue_context(model, cache, question, max_new_tokens=steps, output_logits=True,
                           return_dict_in_generate=True, **GREEDY, **kwargs)
    return out.sequences[:, -steps:], torch.stack(out.logits, dim=1)


@torch.no_grad()
def _greedy_by_hand(model, context, question, steps=4):
    """Prefill the context, feed the question as one chunk, then decode greedily: (tokens, logits)."""
    cache = output_cache(model(context, use_cache=True))
    logits = model(question, **{CACHE: cache}, use_cache=True).logits[:, -1:]
    tokens, all_logits = [], [logits]
    for _ in range(steps - 1):
        tokens.append(logits.argmax(-1))
        logits = model(tokens[-1], **{CACHE: cache}, use_cache=True).logits[:, -1:]
        all_logits.append(logits)
    tokens.append(logits.argmax(-1))
    return torch.cat(tokens, dim=1), torch.cat(all_logits, dim=1)


def _layers(cache):
    return [(layer.keys.clone(), layer.values.clone(), layer.get_seq_length()) for layer in cache.layers]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compress_context_is_compress_on_the_same_prefill(arch):
    model = tiny_model(arch)
    policy = Policy.ripplekv(toy_sensitivity(len(compressible_layers(model))), 0.3, window=WINDOW)
    context = _ids()
    with compress(model, policy), torch.no_grad():
        expected = _layers(output_cache(model(context, use_cache=True)))
    cache = compress_context(model, context, policy)
    got = _layers(cache)
    assert len(got) == len(expected)
    for (k, v, n), (k_e, v_e, n_e) in zip(got, expected):
        assert torch.equal(k, k_e) and torch.equal(v, v_e) and n == n_e == 96
    assert any(k.shape[2] < 96 for k, _, _ in got)  # something was compressed
    assert cache.ripplekv_context.probe_tokens == 0 and torch.equal(cache.ripplekv_context.context_ids, context)


@pytest.mark.parametrize("arch,policy_name", [("llama", "snapkv"), ("qwen2", "ripplekv"), ("llama", "protected")])
def test_answer_equals_the_masked_reference(arch, policy_name):
    # The question comes after compression: its window was the context's tail, so the reference compresses the
    # context alone, then attends to the question and the answer over the kept tokens only.
    model = tiny_model(arch)
    policy = {"snapkv": lambda: Policy.snapkv(0.3, window=WINDOW),
              "protected": lambda: Policy.snapkv(0.3, window=WINDOW, protect=24),
              "ripplekv": lambda: Policy.ripplekv(toy_sensitivity(len(compressible_layers(model))), 0.3,
                                                  window=WINDOW)}[policy_name]()
    context, question = _ids(), _ids(n=6, seed=1)
    tokens, logits = _answer(model, compress_context(model, context, policy), question)
    with MaskedReference(model, policy):
        ref_tokens, ref_logits = _greedy_by_hand(model, context, question)
    full_tokens, full_logits = _greedy_by_hand(model, context, question)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert (logits - full_logits).abs().max().item() > 1e-3  # compression did change the answer's logits


@pytest.mark.parametrize("arch,policy,probe", [
    ("llama", Policy.full(), False), ("llama", Policy.snapkv(1.0, window=WINDOW), False),
    ("gemma3", Policy.snapkv(1.0, window=WINDOW), True)], ids=["full", "keep-all", "keep-all-probe-sliding"])
def test_nothing_dropped_equals_stock_generate(arch, policy, probe):
    # Full, and a budget at the context length (every layer on the compressed path, nothing dropped): the answer
    # is the stock model's on context + question in one prompt. With a probe on gemma3, its tokens went through
    # the sliding-window layers too (window 16 < 96) and must leave no trace there.
    model = tiny_model(arch)
    context, question = _ids(), _ids(n=6, seed=1)
    probe_ids = _ids(n=12, seed=3) if probe else None
    tokens, logits = _answer(model, compress_context(model, context, policy, probe_ids=probe_ids), question)
    stock = model.generate(torch.cat([context, question], 1), max_new_tokens=4, output_logits=True,
                           return_dict_in_generate=True, **GREEDY)
    assert torch.equal(tokens, stock.sequences[:, -4:])
    assert (logits - torch.stack(stock.logits, 1)).abs().max().item() <= 1e-4


def test_questions_do_not_affect_each_other():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.3, window=WINDOW)
    context, first, second = _ids(), _ids(n=6, seed=1), _ids(n=9, seed=2)
    cache = compress_context(model, context, policy)
    before = _layers(cache)
    _answer(model, cache, first)
    after_first = _answer(model, cache, second)
    alone = _answer(model, compress_context(model, context, policy), second)
    assert torch.equal(after_first[0], alone[0]) and torch.equal(after_first[1], alone[1])
    for (k, v, n), (k_b, v_b, n_b) in zip(_layers(cache), before):  # the copies left the context untouched
        assert torch.equal(k, k_b) and torch.equal(v, v_b) and n == n_b == 96
    _answer(model, cache, first, copy_cache=False)  # the last question may continue the cache itself
    assert cache.get_seq_length() == 96 + 6 + 3


def test_continuing_outside_a_compress_block_is_refused():
    """Outside compress() the model's masks are sized for the uncompressed sequence: with equal budgets they would
    silently misalign the kept keys, so the compressed layer refuses the new tokens."""
    model = tiny_model("llama")
    cache = compress_context(model, _ids(), Policy.snapkv(0.3, window=WINDOW))
    with pytest.raises(RuntimeError, match="only be continued inside"):
        model.generate(torch.cat([_ids(), _ids(n=6, seed=1)], dim=1), **{CACHE: cache}, max_new_tokens=2,
                       **GREEDY)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_probe_is_the_window_then_dropped(arch):
    model = tiny_model(arch)
    policy = Policy.snapkv(0.3, window=WINDOW)
    context, probe = _ids(), _ids(n=12, seed=3)
    steps = []
    with compress(model, dataclasses.replace(policy, window=12), on_compress=steps.append), torch.no_grad():
        model(torch.cat([context, probe], 1))
    cache = compress_context(model, context, policy, probe_ids=probe)
    tail_window = compress_context(model, context, policy)
    differs = False
    for step in steps:  # the reference ops: SnapKV scores of the probe's queries, top-k with the probe as window
        idx = ripplekv_ref.select_topk(ripplekv_ref.snapkv_scores(step.queries[:, :, -12:], step.keys),
                                       step.budget, 12)[..., :-12]
        layer = cache.layers[step.layer_idx]
        assert torch.equal(layer.keys, torch.gather(step.keys, 2, idx[..., None].expand(-1, -1, -1,
                                                                                        step.keys.shape[-1])))
        assert layer.get_seq_length() == 96 and layer.keys.shape[2] == step.budget - 12
        differs |= layer.keys.shape != tail_window.layers[step.layer_idx].keys.shape or not torch.equal(
            layer.keys, tail_window.layers[step.layer_idx].keys)
    assert len(steps) == len(compressible_layers(model)) and differs
    # Sliding-window layers (gemma3's window is 16 < 96) are what a prefill of the context alone leaves, though the
    # probe's tokens went through them.
    with torch.no_grad():
        stock = output_cache(model(context, use_cache=True))
    for layer_idx, layer in enumerate(cache.layers):
        if layer_idx not in compressible_layers(model):
            expected = stock.layers[layer_idx]
            assert type(layer) is type(expected) and layer.get_seq_length() == expected.get_seq_length() == 96
            # The context's prefill ran with the probe after it (108 tokens, not 96): the same keys within the
            # rounding of a forward of another shape.
            torch.testing.assert_close(layer.keys, expected.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(layer.values, expected.values, rtol=0, atol=1e-5)
    assert cache.ripplekv_context.probe_tokens == 12 and cache.ripplekv_context.policy == policy
    tokens, _ = _answer(model, cache, _ids(n=6, seed=1))  # and it answers like any compressed context
    assert tokens.shape == (1, 4)


@pytest.mark.parametrize("probe", [False, True], ids=["tail-window", "probe"])
def test_batched_contexts_equal_each_row_alone(probe):
    model = tiny_model("llama")
    policy = Policy.ripplekv(toy_sensitivity(4), 0.3, window=WINDOW)
    rows = [_ids(n=96)[0], _ids(n=72, seed=5)[0]]
    context = torch.zeros(2, 96, dtype=torch.long)
    mask = torch.zeros(2, 96, dtype=torch.long)
    for b, row in enumerate(rows):
        context[b, 96 - len(row):], mask[b, 96 - len(row):] = row, 1
    question, probe_ids = _ids(batch=2, n=6, seed=1), (_ids(n=10, seed=3) if probe else None)
    tokens, logits = _answer(model, compress_context(model, context, policy, attention_mask=mask,
                                                     probe_ids=probe_ids), question)
    for b, row in enumerate(rows):
        alone = _answer(model, compress_context(model, row[None], policy, probe_ids=probe_ids), question[b:b + 1])
        assert torch.equal(tokens[b], alone[0][0]), b
        assert (logits[b] - alone[1][0]).abs().max().item() <= 1e-4, b


def test_bad_inputs_are_clear_errors():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.3, window=WINDOW)
    context = _ids()
    with pytest.raises(ValueError, match=r"average budget of 5 tokens, not above the window \(8\)"):
        compress_context(model, context, Policy.snapkv(0.05, window=WINDOW))
    with pytest.raises(ValueError, match="not above the probe's 50 tokens"):
        compress_context(model, context, policy, probe_ids=_ids(n=50))
    with pytest.raises(TypeError, match="model must be a transformers causal LM"):
        compress_context(object(), context, policy)
    with pytest.raises(TypeError, match="policy must be a ripplekv_ext.Policy"):
        compress_context(model, context, "snapkv")
    with pytest.raises(TypeError, match="context_ids must be a torch.Tensor"):
        compress_context(model, context.tolist(), policy)
    with pytest.raises(TypeError, match="integer token ids"):
        compress_context(model, context.float(), policy)
    with pytest.raises(ValueError, match=r"2-D \[batch, tokens\].*ids\[None\]"):
        compress_context(model, context[0], policy)
    with pytest.raises(ValueError, match="left-padded"):
        compress_context(model, context, policy, attention_mask=torch.cat([torch.ones(1, 90), torch.zeros(1, 6)], 1))

    cache = compress_context(model, context, policy)
    with pytest.raises(ValueError, match="another model.*other weights"):
        continue_context(tiny_model("llama", seed=1), cache, _ids(n=4), max_new_tokens=1)
    with pytest.raises(ValueError, match="another model.*num_layers: 4 vs 2"):
        continue_context(tiny_model("llama", num_layers=2), cache, _ids(n=4), max_new_tokens=1)
    with pytest.raises(TypeError, match="what ripplekv_ext.compress_context returned"):
        continue_context(model, DynamicCache(), _ids(n=4), max_new_tokens=1)
    with pytest.raises(ValueError, match=r"one row per context row \(1\)"):
        continue_context(model, cache, _ids(batch=2, n=4), max_new_tokens=1)
    with pytest.raises(TypeError, match="builds \\['attention_mask'\\] itself"):
        continue_context(model, cache, _ids(n=4), attention_mask=torch.ones(1, 100), max_new_tokens=1)
    assert cache.get_seq_length() == 96  # no failed call touched it


# --- A used context, a saved one, one too short -----------------------------------------------------------------

@pytest.mark.parametrize("copy_again", [False, True])
def test_continuing_a_used_context_is_refused_before_it_changes(copy_again):
    model = tiny_model("llama")
    cache = compress_context(model, _ids(n=96), Policy.snapkv(0.3, window=WINDOW))
    continue_context(model, cache, _ids(n=6, seed=1), copy_cache=False, max_new_tokens=4, **GREEDY)
    seen = cache.get_seq_length()
    assert seen == 96 + 6 + 3
    with pytest.raises(ValueError, match="already continued.*Compress the context again"):
        continue_context(model, cache, _ids(n=6, seed=2), copy_cache=copy_again, max_new_tokens=4, **GREEDY)
    assert cache.get_seq_length() == seen


_CHILD = """
import json, sys, torch
from ripplekv_ext import continue_context
from ripplekv_ext.transformers_front.context import load_context
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.model_info import compressible_layers
question = torch.tensor(json.loads(sys.argv[2]))
out = {}
for arch in ("llama", "gemma3"):
    model = tiny_model(arch)
    for loader in ("load_context", "torch.load"):
        path = f"{arch}.pt"
        cache = load_context(path) if loader == "load_context" else torch.load(path, weights_only=False)
        result = continue_context(model, cache, question, max_new_tokens=4, do_sample=False, temperature=None,
                                  top_p=None, top_k=None, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)
        out[f"{arch}/{loader}"] = {"sequences": result.sequences.tolist(),
                                   "logits": torch.stack(result.logits, 1).tolist()}
json.dump(out, open(sys.argv[1], "w"))
"""


def test_saved_context_continues_in_a_fresh_process_as_the_original(tmp_path):
    context, question = _ids(n=96), _ids(n=6, seed=1)
    expected = {}
    for arch in ("llama", "gemma3"):  # gemma3: sliding-window layers saved alongside the compressed ones
        model = tiny_model(arch)
        # llama's with a protected prefix: the policy's new field travels in the file.
        policy = Policy.ripplekv(toy_sensitivity(len(compressible_layers(model))), 0.3, window=WINDOW,
                                 protect=16 if arch == "llama" else 0)
        cache = compress_context(model, context, policy)
        torch.save(cache, tmp_path / f"{arch}.pt")
        result = continue_context(model, cache, question, max_new_tokens=4, output_logits=True,
                                  return_dict_in_generate=True, **GREEDY)
        expected[arch] = result.sequences, torch.stack(result.logits, 1)
        # In this process too, with torch's safe loader.
        again = continue_context(model, load_context(tmp_path / f"{arch}.pt"), question, max_new_tokens=4,
                                 **GREEDY)
        assert torch.equal(again, result.sequences)
    # A fresh interpreter started in tmp_path: it finds the layer class by its name, not through this process.
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "out.json"), json.dumps(question.tolist())],
                   cwd=tmp_path, check=True, capture_output=True, text=True, timeout=600)
    got = json.loads((tmp_path / "out.json").read_text())
    for key, result in got.items():
        sequences, logits = expected[key.split("/")[0]]
        assert torch.equal(torch.tensor(result["sequences"]), sequences), key
        torch.testing.assert_close(torch.tensor(result["logits"]), logits, atol=1e-4, rtol=1e-4)


def test_load_context_refuses_a_file_that_is_no_context(tmp_path):
    torch.save({"keys": torch.zeros(2)}, tmp_path / "not.pt")
    with pytest.raises(TypeError, match="not a context saved from ripplekv_ext.compress_context"):
        load_context(tmp_path / "not.pt")


def test_every_context_too_short_for_the_policy_is_refused():
    model = tiny_model("llama", num_layers=2)
    policy = Policy.snapkv(0.3, window=WINDOW)
    # round(0.3 * n) <= 8 up to n = 28: the whole range, one token included, is refused with one message.
    for n in (1, 2, 10, 28):
        with pytest.raises(ValueError, match=f"of a {n}-token context is an average budget of .* not above the "
                                             f"window"):
            compress_context(model, _ids(n=n), policy)
    compress_context(model, _ids(n=29), policy)
    # Keep-all policies compress nothing, whatever the length.
    compress_context(model, _ids(n=1), Policy.snapkv(1.0, window=WINDOW))
    compress_context(model, _ids(n=1), Policy.full())


# --- The evaluation harness: protocols "inside" and "after" ---------------------------------------------------

class _DigitsTokenizer:
    """The little a generate_fn needs of a tokenizer: an EOS id, decode (ids as text) and encode (one id per
    character, for compress_context's default probe)."""

    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}


def _split_example(seed=0, n=96, q=6):
    from ripplekv_ext.eval.example import Example

    ids = _ids(n=n + q, seed=seed)[0].tolist()
    return Example(task="toy", id=f"toy-{seed}", prompt="", input_ids=ids, answers=["1"], max_new_tokens=4,
                   metric="contains_all", context_tokens=n)


def test_evaluate_passes_the_split_and_refuses_examples_without_one():
    from ripplekv_ext.eval.runner import evaluate

    seen = []
    report = evaluate([_split_example()], lambda ids, n, context_tokens: seen.append((ids.shape, context_tokens))
                      or "1", progress=False, protocol="after")
    assert seen == [((1, 102), 96)] and report.results[0].protocol == "after" and report.results[0].score == 1.0
    with pytest.raises(ValueError, match="protocol 'after' needs each example's context/question split.*toy/toy-0"):
        evaluate([dataclasses.replace(_split_example(), context_tokens=None)], lambda ids, n, context_tokens: "",
                 progress=False, protocol="after")
    with pytest.raises(ValueError, match="protocol must be one of"):
        evaluate([_split_example()], lambda ids, n: "", progress=False, protocol="before")
    with pytest.raises(ValueError, match=r"context_tokens must leave a context and a question.*\[1, 101\], got 102"):
        dataclasses.replace(_split_example(), context_tokens=102)


def test_grid_reports_both_protocols_side_by_side(tmp_path):
    from ripplekv_ext.cli.evaluation import results_table
    from ripplekv_ext.eval.grid import run_grid

    model, examples = tiny_model("llama"), [_split_example(0), _split_example(1)]
    results = run_grid(model, _DigitsTokenizer(), ["full", "snapkv"], [0.3], task_examples=examples, window=WINDOW,
                       out_path=tmp_path / "eval.json", progress=False, log=lambda *a: None,
                       protocols=["inside", "after"])
    assert results["settings"]["protocols"] == ["inside", "after"]
    full, snapkv = results["cells"]["full"], results["cells"]["snapkv@0.3"]
    # Full: the context and the question prefilled apart decode what the whole prompt decodes.
    assert [p["prediction"] for p in full["after"]["predictions"]] == [p["prediction"] for p in full["predictions"]]
    # SnapKV "after": the context compressed alone (scored by the default probe), then the question, as
    # continue_context.
    policy = Policy.snapkv(0.3, window=WINDOW)
    for example, predicted in zip(examples, snapkv["after"]["predictions"]):
        ids = torch.tensor([example.input_ids])
        cache = compress_context(model, ids[:, :96], policy, tokenizer=_DigitsTokenizer())
        assert cache.ripplekv_context.probe_tokens == len(DEFAULT_PROBE)
        out = continue_context(model, cache, ids[:, 96:], max_new_tokens=4, **dict(GREEDY, pad_token_id=2),
                               eos_token_id=[2])
        assert predicted["prediction"] == _DigitsTokenizer().decode(out[0, 102:])
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(results_table(results))
    header = console.export_text().splitlines()
    assert any("toy" in line and "toy after" in line and "task mean after" in line for line in header)

    # A cell whose "after" results were dropped from the file (what that protocol runs changed) runs only them.
    saved = json.loads((tmp_path / "eval.json").read_text())
    del saved["cells"]["snapkv@0.3"]["after"]
    (tmp_path / "eval.json").write_text(json.dumps(saved))
    logged = []
    again = run_grid(model, _DigitsTokenizer(), ["full", "snapkv"], [0.3], task_examples=examples, window=WINDOW,
                     out_path=tmp_path / "eval.json", progress=False, log=logged.append,
                     protocols=["inside", "after"])
    assert logged == ["[1/2] full: already in " + str(tmp_path / "eval.json") + ", skipped",
                      "[2/2] snapkv@0.3: after only"]
    assert again["cells"]["snapkv@0.3"]["after"] == snapkv["after"]
    assert again["cells"]["snapkv@0.3"]["predictions"] == snapkv["predictions"]


@pytest.fixture(scope="module")
def smollm2():
    from ripplekv_ext.eval.models import load_smollm2

    torch.set_num_threads(1)
    return load_smollm2()


def test_longbench_and_user_prompts_split_before_the_question(smollm2, tmp_path):
    import json

    from ripplekv_ext.eval import load_longbench, load_user_jsonl

    tokenizer = smollm2[1]
    records = {"hotpotqa": {"input": "Who wrote it?", "context": " ".join(f"w{i}" for i in range(600)),
                            "answers": ["Ann"], "_id": "h0"},
               "gov_report": {"input": "", "context": "Report text. " * 40, "answers": ["x"], "_id": "g0"}}
    for name, record in records.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "mine.jsonl").write_text(json.dumps({"context": "Ann wrote it.", "question": "Who wrote it?",
                                                     "answers": ["Ann"]}) + "\n")
    examples = load_longbench(tmp_path, tokenizer, max_prompt_tokens=300) + load_user_jsonl(tmp_path / "mine.jsonl",
                                                                                               tokenizer)
    # The context ends with the document (cut in the middle); the template's text after {context} follows it.
    expected = {"h0": ("w599", "Answer the question based on the given passages. Only give me the answer and do "
                               "not output any other words.\n\nQuestion: Who wrote it?\nAnswer:"),
                "g0": ("Report text.", "Now, write a one-page summary of the report.\n\nSummary:"),
                "1": ("Ann wrote it.", "Now, answer the following question based on the above text, only give me "
                                       "the answer and do not output any other words.\n\nQuestion: Who wrote it?")}
    assert sorted(e.id for e in examples) == sorted(expected)
    for example in examples:
        tail, question_part = expected[example.id]
        context = tokenizer.decode(example.input_ids[:example.context_tokens])
        question = tokenizer.decode(example.input_ids[example.context_tokens:])
        assert context.startswith("<|im_start|>system") and context.rstrip().endswith(tail), example.id
        assert question.strip().startswith(question_part) and question.rstrip().endswith("assistant"), example.id


def test_smollm2_passkey_under_both_protocols(smollm2):
    from ripplekv_ext.eval import make_synthetic
    from ripplekv_ext.eval.runner import evaluate, protocol_generate_fn

    model, tokenizer = smollm2
    [example] = make_synthetic("passkey", tokenizer, length=256, num_examples=1)
    context = tokenizer.decode(example.input_ids[:example.context_tokens])
    assert "pass key is" in context and "What is the pass key?" not in context  # the needle is in, the question not
    reports = {protocol: evaluate([example], protocol_generate_fn(protocol, model, tokenizer, Policy.full()),
                                  progress=False, protocol=protocol) for protocol in ("inside", "after")}
    assert reports["inside"].results[0].score == reports["after"].results[0].score == 1.0
    assert reports["inside"].results[0].prediction == reports["after"].results[0].prediction


@pytest.mark.parametrize("argv, message", [
    (["--protocols", "inside,before"], "protocols must be distinct names among inside, after"),
    (["--protocols", "after,after"], "protocols must be distinct names among inside, after"),
    (["--protocols", "after", "--tasks", "fidelity"], "--protocols after compresses a context before its question"),
])
def test_protocols_option_errors(argv, message, capsys):
    from ripplekv_ext import cli

    code = cli.main(["eval", *argv])
    assert code != 0 and message in capsys.readouterr().err
