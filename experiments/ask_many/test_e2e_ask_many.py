"""The ask-many experiment's prompts: the needle goes into the passkey context far from the pass key, and each
question part is the passkey question's turn with only the question changed."""

import e2e_ask_many  # experiments/ask_many/e2e_ask_many.py, beside this file


def test_each_context_holds_both_needles_and_three_questions():
    from ripplekv_ext.eval.models import load_smollm2
    from ripplekv_ext.eval.needle import NEEDLE, QUESTION
    from ripplekv_ext.eval.synthetic import even_depths, make_synthetic

    _, tokenizer = load_smollm2()
    for example in make_synthetic("passkey_text", tokenizer, num_examples=5, seed=1, depths=even_depths(5)):
        context, questions = e2e_ask_many.with_needle(example, tokenizer)
        text = tokenizer.decode(context[0])
        key_at, needle_at = text.index(example.answers[0]) / len(text), text.index(NEEDLE.strip()) / len(text)
        assert abs(key_at - needle_at) > 0.3, (key_at, needle_at)
        # Nothing else changed: without the needle, the text is the passkey context's.
        assert text.replace(NEEDLE.strip() + " ", "", 1) == tokenizer.decode(example.input_ids[:example.context_tokens])
        turns = {name: tokenizer.decode(ids[0]) for name, ids in questions.items()}
        assert turns["passkey"] == tokenizer.decode(example.input_ids[example.context_tokens:])
        assert turns["needle"] == "\n\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
        assert turns["content"] == "\n\n" + e2e_ask_many.CONTENT_QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
