"""RippleKV sensitivity profiler (docs/design.md §4).

For each calibration example (prefix of P tokens, continuation of T tokens) the prefix is run once; the
continuation is run teacher-forced against the clean cache (reference distributions), then once per
profiled layer `l` and noise draw against a cache whose layer-`l` prefix Values are perturbed:
`v' = v + sigma * ||v|| / sqrt(D) * eps`. Sensitivity `s_l` = mean KL(P_ref || P_l) over positions, draws
and examples.

Cost: layers before `l` never see the perturbation, so their outputs on the continuation are recorded
once in the reference pass and replayed; only layers `l..L-1` run. This is checked against a full forward
pass on the first example and falls back to full passes if the model's layers cannot be replayed.

Cheaper ways to the same ranking (docs/profiling.md has what each costs and buys): `batch_rows` runs many
perturbed continuations as one batch (each row enters at its own layer; same numbers); `antithetic` adds each
draw's negated noise; `estimator="fisher"` gets every layer from one backward pass (`fisher_example`). `--fast`
(FAST_SETTINGS) is the Fisher estimator on short examples, stopping by itself once the profile is stable.

The parts: `runner` (a continuation against a modified prefix cache), `noise` (the perturbation and its seeds),
`perturbation` and `fisher` (the two estimators, one example each), `run` (`profile_model`: examples, resume,
progress), `partial` (the file an interrupted run resumes from), `cost` (the token count), `report` (the table).
The input is token ids; `ripplekv_ext.eval.corpus.calibration_examples` cuts them from text.

    ripplekv profile --model smollm2 --prefix-len 1024 --cont-len 64 --examples 8 \\
        --out bench/results/smollm2_profile.json
    ripplekv profile --model smollm2 --fast
"""

from ripplekv_ext.profiler.cost import BACKWARD_COST, tokens_processed
from ripplekv_ext.profiler.fisher import fisher_example
from ripplekv_ext.profiler.noise import noise_seed, perturb, perturber
from ripplekv_ext.profiler.partial import PARTIAL_SUFFIX
from ripplekv_ext.profiler.perturbation import perturbation_example
from ripplekv_ext.profiler.report import format_profile
from ripplekv_ext.profiler.run import (ESTIMATORS, FAST_SETTINGS, METRIC, PLAIN_SETTINGS, profile_example,
                                       profile_model, sliding_prefix_len)
from ripplekv_ext.profiler.runner import ContinuationRunner

__all__ = ["BACKWARD_COST", "tokens_processed", "fisher_example", "noise_seed", "perturb", "perturber",
           "PARTIAL_SUFFIX", "perturbation_example", "format_profile", "ESTIMATORS", "FAST_SETTINGS", "METRIC",
           "PLAIN_SETTINGS", "profile_example", "profile_model", "sliding_prefix_len", "ContinuationRunner"]
