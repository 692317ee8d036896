"""The synthetic suite (ripplekv_ext.eval) end to end on the real SmolLM2-135M-Instruct (greedy, short prompts to
stay fast): the full cache solves the passkey task, and a fake compression that drops the needle's part of the prompt
does not."""

import pytest
import torch

from ripplekv_ext.eval import evaluate, greedy_generate_fn, make_synthetic

LENGTH = 256


@pytest.fixture(scope="module")
def smollm2():
    from ripplekv_ext.eval.models import load_smollm2

    return load_smollm2(torch.float32)


def keep_ends(generate_fn, head, tail):
    """A fake compression (StreamingLLM-like): the model sees only the first ``head`` and last ``tail`` tokens."""
    return lambda ids, n: generate_fn(torch.cat([ids[:, :head], ids[:, -tail:]], dim=1), n)


def test_full_cache_solves_passkey_and_dropping_the_needle_fails(smollm2):
    model, tokenizer = smollm2
    examples = make_synthetic("passkey", tokenizer, LENGTH, num_examples=2, seed=0)
    full = greedy_generate_fn(model, tokenizer)
    full_report = evaluate(examples, full, progress=False)
    assert [r.score for r in full_report.results] == [1.0, 1.0], [r.prediction for r in full_report.results]

    head, tail = 40, 40
    for e in examples:  # precondition: the kept tokens do not contain the key
        kept = tokenizer.decode(e.input_ids[:head] + e.input_ids[-tail:])
        assert e.answers[0] not in kept
    truncated_report = evaluate(examples, keep_ends(full, head, tail), progress=False)
    assert [r.score for r in truncated_report.results] == [0.0, 0.0], [r.prediction for r in truncated_report.results]
