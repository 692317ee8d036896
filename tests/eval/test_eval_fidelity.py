"""Fidelity metrics and the generation runner (ripplekv_ext.eval.fidelity, ripplekv_ext.eval.runner), on a tiny
random Llama (fast) with a fake compression, and the fidelity harness's shared prefill under the hook."""

import contextlib

import pytest
import torch
from scipy.special import rel_entr

from ripplekv_ext.eval import (Example, continuation_logits_fn, evaluate, evaluate_fidelity, greedy_generate_fn,
                               kl_per_position, nll_per_position)
from ripplekv_ext.eval.tiny_models import tiny_model

PREFIX, CONT = 24, 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def examples(model):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (3, PREFIX + CONT), generator=g)


def truncating_logits_fn(model, keep):
    """A fake compression: the model only sees the last ``keep`` prefix tokens."""
    full = continuation_logits_fn(model)
    return lambda prefix, continuation: full(prefix[:, -keep:], continuation)


def test_continuation_logits_equal_one_forward_over_the_whole_sequence(model, examples):
    # Prefill + teacher-forced continuation against the cache must equal a single causal forward.
    logits = continuation_logits_fn(model)(examples[:1, :PREFIX], examples[:1, PREFIX:])
    with torch.inference_mode():
        whole = model(examples[:1]).logits[0, PREFIX - 1:-1].float()
    assert logits.shape == (CONT, model.config.vocab_size)
    torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)


def test_kl_matches_scipy_and_nll_matches_cross_entropy():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    p, q = torch.softmax(a.double(), -1).numpy(), torch.softmax(b.double(), -1).numpy()
    expected = torch.tensor(rel_entr(p, q).sum(-1), dtype=torch.float32)
    torch.testing.assert_close(kl_per_position(a, b), expected, rtol=1e-5, atol=1e-6)
    assert torch.all(kl_per_position(a, a).abs() < 1e-6)
    targets = torch.tensor([0, 3, 10, 2, 5])
    torch.testing.assert_close(nll_per_position(a, targets),
                               torch.nn.functional.cross_entropy(a, targets, reduction="none"))
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        kl_per_position(a, b[:4])


def test_full_against_itself_is_exact(model, examples):
    full = continuation_logits_fn(model)
    summary = evaluate_fidelity(examples, PREFIX, full, full, progress=False).summary()
    assert summary["kl"] == 0.0
    assert summary["nll_full"] == summary["nll_compressed"]
    assert summary["examples"] == 3


def test_truncated_prefix_moves_the_distribution(model, examples):
    full = continuation_logits_fn(model)
    report = evaluate_fidelity(examples, PREFIX, full, truncating_logits_fn(model, keep=4), progress=False)
    summary = report.summary()
    assert all(kl > 1e-4 for kl in report.kl)
    assert summary["kl_stderr"] > 0
    # The full run's NLL equals HF's own loss on the continuation (an independent computation).
    with torch.inference_mode():
        losses = [model(examples[i:i + 1], labels=torch.cat([torch.full((1, PREFIX), -100), examples[i:i + 1, PREFIX:]],
                                                            dim=1)).loss.item() for i in range(3)]
    assert report.nll_full == pytest.approx(losses, rel=1e-4)


def test_compression_factory_is_entered_once_per_example(model, examples):
    entered = []

    @contextlib.contextmanager
    def fake_compression():
        entered.append(True)
        yield

    full = continuation_logits_fn(model)
    wrapped = continuation_logits_fn(model, compression=fake_compression)
    report = evaluate_fidelity(examples, PREFIX, full, wrapped, progress=False)
    assert len(entered) == 3
    assert report.summary()["kl"] == 0.0


def test_fidelity_rejects_bad_input(model, examples):
    full = continuation_logits_fn(model)
    with pytest.raises(ValueError, match=r"prefix_len must be in \[1, 31\].*got 32"):
        evaluate_fidelity(examples, PREFIX + CONT, full, full, progress=False)
    with pytest.raises(ValueError, match="int64"):
        evaluate_fidelity(examples.float(), PREFIX, full, full, progress=False)
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        evaluate_fidelity(examples, PREFIX, full, lambda p, c: full(p, c)[:-1], progress=False)


class _IdTokenizer:
    """Decodes ids as space-separated numbers: enough for the runner, independent of any vocabulary."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def _manual_greedy(model, ids, steps):
    ids = ids.clone()
    with torch.inference_mode():
        for _ in range(steps):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, -steps:]


def test_greedy_generate_fn_is_greedy_and_runs_inside_the_compression(model, examples):
    model.generation_config.eos_token_id = None  # the random model must not stop early
    entered = []

    @contextlib.contextmanager
    def fake_compression():
        entered.append(True)
        yield

    generate = greedy_generate_fn(model, _IdTokenizer(), compression=fake_compression)
    text = generate(examples[:1, :PREFIX], 5)
    assert text == " ".join(str(int(i)) for i in _manual_greedy(model, examples[:1, :PREFIX], 5))
    assert len(entered) == 1


def test_evaluate_scores_each_example_and_averages_tasks():
    def make(task, i, answer):
        return Example(task=task, id=str(i), prompt="", input_ids=[1, 2, i], answers=[answer], max_new_tokens=4,
                       metric="contains_all")

    examples = [make("a", 0, "7"), make("a", 1, "8"), make("b", 2, "9")]
    # A fake model that "knows" the answer only when the last prompt token is even.
    def fake(ids, n):
        last = ids[0, -1].item()
        return f"it is {last + 7}" if last % 2 == 0 else "no idea"

    report = evaluate(examples, fake, progress=False)
    assert [r.score for r in report.results] == [1.0, 0.0, 1.0]
    assert report.task_scores() == {"a": 50.0, "b": 100.0}
    assert report.mean() == 75.0
    with pytest.raises(TypeError, match="str"):
        evaluate(examples, lambda ids, n: ids, progress=False)


def test_example_validation():
    with pytest.raises(ValueError, match="metric must be one of"):
        Example(task="t", id="0", prompt="", input_ids=[1], answers=["a"], max_new_tokens=1, metric="bleu")
    with pytest.raises(ValueError, match="answers must be a non-empty list"):
        Example(task="t", id="0", prompt="", input_ids=[1], answers="a", max_new_tokens=1, metric="qa_f1")
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        Example(task="t", id="0", prompt="", input_ids=[1], answers=["a"], max_new_tokens=0, metric="qa_f1")


# ---- one prefill for many policies (the report's fidelity grid) ---------------------------------------------------

def _shared_prefill_policies(num_layers):
    from ripplekv_ext import AdaKVSelector, Policy, UniformAllocator

    sensitivity = [0.5 + (i % 3) for i in range(num_layers)]
    return {f"{name}@{r}": make(r) for r in (0.25, 0.5) for name, make in {
        "snapkv": lambda r: Policy.snapkv(r, window=8),
        "pyramidkv": lambda r: Policy.pyramidkv(r, window=8),
        "ripplekv": lambda r: Policy.ripplekv(sensitivity, r, window=8),
        "streamingllm": lambda r: Policy.streamingllm(r, window=8),
        "cake": lambda r: Policy.cake(r, window=8),  # budgets from every layer's window: cut at the end
        "adakv": lambda r: Policy(UniformAllocator(), AdaKVSelector(), r, window=8)}.items()}  # per-head masks


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding-window layers beside compressed ones
def test_shared_prefill_gives_the_logits_of_plain_runs_under_the_hook(arch):
    from ripplekv_ext import Policy, compress
    from ripplekv_ext.eval.fidelity import SharedPrefill

    model = tiny_model(arch, seed=1, num_layers=4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 96 + CONT), generator=g)
    shared = SharedPrefill(model, window=8, capture_retention=0.25)
    full = continuation_logits_fn(model)(ids[:1, :96], ids[:1, 96:])
    torch.testing.assert_close(shared.logits_fn(Policy.full())(ids[:1, :96], ids[:1, 96:]), full, atol=1e-4, rtol=1e-4)
    compressible = 4 if arch == "llama" else 2  # gemma3's tiny config: every second layer slides
    for name, policy in _shared_prefill_policies(compressible).items():
        for row in range(2):  # the second prefix is a second entry of the shared prefills
            prefix, continuation = ids[row:row + 1, :96], ids[row:row + 1, 96:]
            plain = continuation_logits_fn(model, lambda p=policy: compress(model, p))(prefix, continuation)
            torch.testing.assert_close(shared.logits_fn(policy)(prefix, continuation), plain, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"{arch} {name} row {row}: {m}")
            assert (plain - full).abs().max() > 1e-3, f"{arch} {name}: compression changed nothing (no power)"
    assert len(shared._prefills) == 2  # one prefill per prompt, whatever the number of policies


def test_shared_prefill_refuses_what_it_cannot_reproduce():
    from ripplekv_ext import Policy
    from ripplekv_ext.eval.fidelity import SharedPrefill

    shared = SharedPrefill(tiny_model("llama"), window=8)
    for policy in (Policy.h2o(0.2, window=8), Policy.snapkv(0.2, window=16),
                   Policy.snapkv(0.2, window=8, decode_every=4)):
        assert not shared.supports(policy)
        with pytest.raises(ValueError, match="SharedPrefill needs window 8"):
            shared.logits_fn(policy)
    assert shared.supports(Policy.full()) and shared.supports(Policy.streamingllm(0.2, window=8))
