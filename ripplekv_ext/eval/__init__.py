"""Evaluation tasks: model-agnostic examples, generation runners and fidelity metrics.

A task turns data into :class:`Example` objects (token ids, references, a metric, a generation length);
:func:`evaluate` runs any ``generate_fn(input_ids, max_new_tokens) -> text`` over them. Fidelity compares two
``logits_fn(prefix_ids, continuation_ids) -> logits`` callables (full vs compressed). Compression is plugged in as
a context-manager factory (``lambda: ripplekv_ext.compress(model, policy)``) or as any callable.

Built on the core library (which never imports this package), beside the tasks: ``grid`` (methods x retentions),
``diagnostics`` (isolated compression damage vs the profile), ``plots``, ``corpus`` (the bundled KJV text),
``models`` (the known real models, their loading and profile paths, for the CLI and the benchmarks), ``tiny_models``
(small random models of every supported architecture, built in memory).
"""

from ripplekv_ext.eval.example import Example, render_prompt, truncate_middle
from ripplekv_ext.eval.fidelity import (FidelityReport, continuation_logits_fn, evaluate_fidelity,
                                        fidelity_examples, kl_per_position, nll_per_position)
from ripplekv_ext.eval.longbench import load_longbench, longbench_config, longbench_datasets, longbench_scores
from ripplekv_ext.eval.metrics import METRICS, score
from ripplekv_ext.eval.runner import EvalReport, ExampleResult, evaluate, greedy_generate_fn
from ripplekv_ext.eval.synthetic import DEFAULT_LENGTHS, SYNTHETIC_TASKS, make_synthetic
from ripplekv_ext.eval.userdata import load_user_jsonl

__all__ = [
    "Example", "render_prompt", "truncate_middle",
    "FidelityReport", "continuation_logits_fn", "evaluate_fidelity", "fidelity_examples", "kl_per_position",
    "nll_per_position",
    "load_longbench", "longbench_config", "longbench_datasets", "longbench_scores",
    "METRICS", "score",
    "EvalReport", "ExampleResult", "evaluate", "greedy_generate_fn",
    "DEFAULT_LENGTHS", "SYNTHETIC_TASKS", "make_synthetic",
    "load_user_jsonl",
]
