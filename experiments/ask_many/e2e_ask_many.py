"""Compress once, ask many, on real text: one compressed context, three different questions, against Full.

Each context is a held-out passkey-in-prose prompt (``passkey_text``, about 1,750 tokens of KJV or essays running
text with the pass key at one of 5 depths) with the needle sentence ("The best thing to do in San Francisco is ...")
put at another depth, compressed once by ``compress_context`` at ``--retention`` (20%, ``Policy.ripplekv`` with the
shipped profile) under each ``--scorings`` scoring (and Full), then asked, one after the other from copies of that
one cache (``continue_context``): the pass key, the needle's question, and a question about the text's content
("What is the text above about?"). The pass key and the needle are scored against the truth (the number in the
answer, as the passkey task scores it; the key phrases' share); every answer also against what Full answers to the
same question (identical text, and token F1). The first context is also saved and loaded back (``torch.save`` /
``load_context``) and asked again: its answers must be those of the cache in memory. One thread; results after every
context to ``--out``; a rerun resumes.

    .venv/bin/python experiments/ask_many/e2e_ask_many.py --model smollm2 --contexts 10
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CONTENT_QUESTION = "What is the text above about? Answer in one sentence."
NEEDLE_DEPTHS = (0.15, 0.85)  # the needle goes to the one of these farther from the pass key


def build_parser():
    p = argparse.ArgumentParser(prog="experiments/ask_many/e2e_ask_many.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--contexts", type=int, default=10)
    p.add_argument("--seed", type=int, default=1, help="passkey_text seed (1: the held-out set)")
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--scorings", default="probe,surprisal")
    p.add_argument("--out", default=None)
    return p


def with_needle(example, tokenizer):
    """The example's context text with the needle sentence inserted at a sentence end far from the pass key, and
    the three question parts (each: the question, the user turn's end, the assistant's opening)."""
    from ripplekv_ext.eval.needle import NEEDLE, QUESTION

    context = tokenizer.decode(example.input_ids[:example.context_tokens])
    question_part = tokenizer.decode(example.input_ids[example.context_tokens:])
    key_at = context.index(example.answers[0]) / len(context)
    depth = max(NEEDLE_DEPTHS, key=lambda d: abs(d - key_at))
    cut = context.find(". ", int(depth * len(context))) + 2
    context = context[:cut] + NEEDLE.strip() + " " + context[cut:]
    passkey_question = question_part.split("\n\n", 1)[1].split("?", 1)[0] + "?"
    questions = {"passkey": question_part}
    # The other questions take the passkey question's place; the answer prefix "The pass key is" is the passkey's.
    turn_end = question_part.split(passkey_question, 1)[1]
    turn_end = turn_end.replace(" Answer with the number only.", "").rsplit("The pass key is", 1)[0]
    questions["needle"] = "\n\n" + QUESTION + turn_end
    questions["content"] = "\n\n" + CONTENT_QUESTION + turn_end

    def encode(text):
        return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])

    return encode(context), {name: encode(text) for name, text in questions.items()}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    from ripplekv_ext import Policy, compress_context, continue_context, load_context
    from ripplekv_ext.jsonio import write_json_atomic
    from ripplekv_ext.eval.metrics import contains_all, phrase_recall, qa_f1
    from ripplekv_ext.eval.models import load_model, shipped_profile_path
    from ripplekv_ext.eval.needle import KEY_PHRASES
    from ripplekv_ext.eval.runner import greedy_options
    from ripplekv_ext.eval.synthetic import even_depths, make_synthetic
    from ripplekv_ext.budgets.profile_file import load_profile

    model, tokenizer, name = load_model(args.model)
    policy = Policy.ripplekv(load_profile(shipped_profile_path(args.model), model=model), args.retention)
    options = greedy_options(model, tokenizer)
    examples = make_synthetic("passkey_text", tokenizer, num_examples=args.contexts, seed=args.seed,
                              depths=even_depths(5))
    out = Path(args.out or RESULTS / f"e2e_ask_many_{args.model}.json")
    results = json.loads(out.read_text()) if out.is_file() else {}
    results.update({"figure": "compress once, ask many (real text)", "model": name, "seed": args.seed,
                    "retention": args.retention, "policy": repr(policy), "threads": 1,
                    "questions": ["passkey", "needle", "content"]})
    contexts = results.setdefault("contexts", {})
    scorings = ["full"] + args.scorings.split(",")
    max_new = {"passkey": 12, "needle": 32, "content": 32}
    for i, example in enumerate(examples):
        if example.id in contexts:
            continue
        context, questions = with_needle(example, tokenizer)
        row = {"context_tokens": context.shape[1], "answers": {}}

        def ask(cache):
            """Each question's answer from a copy of ``cache``."""
            answers = {}
            for question, ids in questions.items():
                output = continue_context(model, cache, ids, max_new_tokens=max_new[question], **options)
                answers[question] = tokenizer.decode(output[0, context.shape[1] + ids.shape[1]:],
                                                     skip_special_tokens=True)
            return answers

        for scoring in scorings:
            with torch.inference_mode():
                cache = compress_context(model, context, Policy.full() if scoring == "full" else policy,
                                         tokenizer=tokenizer, scoring=None if scoring == "full" else scoring)
                answers = ask(cache)
                if i == 0 and scoring != "full":
                    with tempfile.TemporaryDirectory() as folder:
                        torch.save(cache, Path(folder) / "context.pt")
                        loaded = load_context(Path(folder) / "context.pt")
                    for question, again in ask(loaded).items():
                        if again != answers[question]:
                            raise SystemExit(f"{scoring}: the saved context answered {question!r} with {again!r}, "
                                             f"the one in memory with {answers[question]!r}")
                    row["saved_context_answers_equal"] = True
            row["answers"][scoring] = answers
        full = row["answers"]["full"]
        row["scores"] = {scoring: {"passkey": contains_all(a["passkey"], example.answers[0]),
                                   "needle": phrase_recall(a["needle"], "|".join(KEY_PHRASES)),
                                   "same_as_full": {q: a[q].strip() == full[q].strip() for q in questions},
                                   "f1_to_full": {q: qa_f1(a[q], full[q]) for q in questions}}
                         for scoring, a in row["answers"].items()}
        contexts[example.id] = row
        write_json_atomic(out, results)
        print(example.id, {s: (v["passkey"], round(v["needle"], 2), sum(v["same_as_full"].values()))
                           for s, v in row["scores"].items()}, flush=True)
    summary = {}
    for scoring in scorings:
        rows = [c["scores"][scoring] for c in contexts.values()]
        summary[scoring] = {"contexts": len(rows), "passkey": sum(r["passkey"] for r in rows),
                            "needle": sum(r["needle"] for r in rows),
                            **{f"same_as_full_{q}": sum(r["same_as_full"][q] for r in rows) for q in max_new},
                            **{f"f1_to_full_{q}": sum(r["f1_to_full"][q] for r in rows) / len(rows) for q in max_new}}
    results["summary"] = summary
    write_json_atomic(out, results)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
