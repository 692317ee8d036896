"""At which prompt length does SmolLM2-135M-Instruct (full cache, greedy) still solve each synthetic task?

Sets ripplekv_ext.eval.synthetic.DEFAULT_LENGTHS: a task the full model fails says nothing about compression.
Lengths are tried in increasing order (all tasks at one length, then the next); at each length the seeded examples run
one by one and the length is decided as soon as the outcome is certain (``--threshold`` of ``--examples`` reached, or
too many
failures to reach it), which saves most of the cost of the long prompts. A failed length ends the task (longer
prompts are not easier). Not a test: it takes minutes to an hour on a CPU.

    .venv/bin/python experiments/synthetic_lengths/measure_synthetic_lengths.py --threads 1 \
        --out /tmp/synthetic_lengths.json

On a 2-core machine shared with other jobs, one torch thread was ~4x faster than two (no oversubscription).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.eval.runner import evaluate, greedy_generate_fn
from ripplekv_ext.eval.synthetic import SYNTHETIC_TASKS, make_synthetic


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(SYNTHETIC_TASKS), choices=SYNTHETIC_TASKS)
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--examples", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.8, help="share of examples that must be solved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from ripplekv_ext.eval.models import load_smollm2
    model, tokenizer = load_smollm2(torch.float32)
    generate = greedy_generate_fn(model, tokenizer)
    need = int(round(args.threshold * args.examples + 1e-9))
    results = {task: [] for task in args.tasks}
    alive = list(args.tasks)
    # Length-major order: every task gets its short lengths measured before any long (slow) one.
    for length in sorted(args.lengths):
        for task in list(alive):
            examples = make_synthetic(task, tokenizer, length, num_examples=args.examples, seed=args.seed)
            solved = failed = 0
            started = time.time()
            for example in examples:
                result = evaluate([example], generate, progress=False).results[0]
                solved += result.score == 1.0
                failed += result.score != 1.0
                print(f"{task:>18} {length:>5} {example.id}: {result.score:.0f} {result.prediction!r} "
                      f"(expected {result.answers[0]!r})", flush=True)
                if solved >= need or failed > args.examples - need:
                    break
            passed = solved >= need
            results[task].append(dict(length=length, solved=solved, run=solved + failed, passed=passed,
                                      seconds=round(time.time() - started, 1)))
            print(f"== {task} @ {length}: {solved}/{solved + failed} solved -> "
                  f"{'PASS' if passed else 'FAIL'}", flush=True)
            if args.out:
                write_json_atomic(args.out, results)
            if not passed:
                alive.remove(task)

    print("\ntask                 longest length solved (>= {:.0%} of {} examples)".format(args.threshold,
                                                                                       args.examples))
    for task, rows in results.items():
        good = [r["length"] for r in rows if r["passed"]]
        detail = ", ".join(f"{r['length']}: {r['solved']}/{r['run']}" for r in rows)
        print(f"{task:<20} {max(good) if good else 'none':<6} ({detail})")


if __name__ == "__main__":
    sys.exit(main())
