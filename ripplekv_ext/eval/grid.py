"""Methods x retentions on a set of tasks: the grid behind `ripplekv eval` and `ripplekv demo`.

Each cell (method at one retention) runs fidelity (KL and NLL of a teacher-forced continuation) and the
generation tasks with the model's cache compressed by that policy. Results are written atomically after
every cell; a rerun with the same settings picks up where an interrupted one stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.eval.fidelity import SharedPrefill, continuation_logits_fn, evaluate_fidelity
from ripplekv_ext.eval.runner import PROTOCOLS, evaluate, protocol_generate_fn, protocol_settings
from ripplekv_ext.transformers_front.compress_block import compress
from ripplekv_ext.methods import is_full, make_policy, needs_profile
from ripplekv_ext.policies import DEFAULT_WINDOW

FORMAT = "ripplekv-eval"
FORMAT_VERSION = 2  # 2: fidelity cells keep each example's KL (for paired comparisons) and a CI of the mean


def cell_key(method: str, retention: Optional[float]) -> str:
    return "full" if is_full(method) else f"{method}@{retention:g}"


def _memoized(logits_fn):
    """Full-cache logits do not depend on the method: compute them once per example."""
    cache = {}

    def fn(prefix, continuation):
        key = (prefix.numpy().tobytes(), continuation.numpy().tobytes())
        if key not in cache:
            cache[key] = logits_fn(prefix, continuation)
        return cache[key]

    return fn


def _load_resumable(path: Optional[Path], settings: dict) -> dict:
    """The cells of a saved run of the same experiment. The methods and retentions may differ (a report that
    adds a method keeps the cells it has); each cell is checked against its policy when it is reused."""
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    saved = data.get("settings") or {}
    # Checked cell by cell instead (a protocol added to a saved run runs in the cells that lack it).
    per_cell = ("methods", "retentions", "profile_sensitivity", "protocols")
    comparable = lambda d: {k: v for k, v in d.items() if k not in per_cell}  # noqa: E731
    if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION or comparable(saved) != comparable(
            settings):
        return {}  # another experiment: start afresh (the file is replaced atomically at the first cell)
    cells = data.get("cells", {})
    if saved.get("profile_sensitivity") != settings.get("profile_sensitivity"):
        # Another profile: a cell that allocated with one is reused only if its policy's repr names the profile.
        cells = {key: cell for key, cell in cells.items() if "policy_repr" in cell or not needs_profile(cell["method"])}
    return cells


def same_policy(cell: dict, policy) -> bool:
    # A method's name can come to mean another policy (a default changed): a saved cell is reused only for the
    # policy it measured. Cells saved before the policy's repr was recorded are matched by its name.
    if "policy_repr" in cell:
        return cell["policy_repr"] == _repr_as_saved(policy, cell["policy_repr"])
    return cell.get("policy") == policy.name


def _repr_as_saved(policy, saved_repr: str) -> str:
    """``repr(policy)`` without the fields a cell's saved repr lacks that are at their default: a field added to
    ``Policy`` after the cell was saved, left at the default that does what the policy did before, changes
    nothing the cell measured."""
    shown = [f for f in dataclasses.fields(policy) if f.repr and (
        f"{f.name}=" in saved_repr or getattr(policy, f.name) != f.default)]
    return f"{type(policy).__qualname__}({', '.join(f'{f.name}={getattr(policy, f.name)!r}' for f in shown)})"


def _without_stale_protocols(cell: dict, runs: Sequence[str], policy, tokenizer) -> dict:
    """``cell`` without the results (kept under the protocol's name) of a protocol this method no longer runs or
    ran with other settings (``runner.protocol_settings``: a saved "after" result of another scoring)."""
    stale = {p for p in PROTOCOLS if p != "inside" and p in cell and (p not in runs or any(
        cell[p].get(k) != v for k, v in protocol_settings(p, policy, tokenizer).items()))}
    return {k: v for k, v in cell.items() if k not in stale}


def run_grid(model, tokenizer, methods: Sequence[str], retentions: Sequence[float], *, profile=None,
             fidelity_ids: Optional[torch.Tensor] = None, prefix_len: int = 0, task_examples=(),
             window: int = DEFAULT_WINDOW, settings: Optional[dict] = None, out_path=None, progress: bool = True,
             log=print, protocols: Sequence[str] = ("inside",), after_methods: Optional[Sequence[str]] = None) -> dict:
    """Evaluate every method at every retention (Full once) and return the results document.

    Args:
        fidelity_ids: ``[E, prefix_len + T]`` token ids for the fidelity task, or None to skip it.
        task_examples: generation examples (synthetic, LongBench, user JSONL) scored per task.
        settings: what defines this experiment (model, tasks, sizes); a saved file with other settings is
            not resumed from.
        out_path: JSON results file, rewritten atomically after every cell.
        protocols: where the question goes (``runner.PROTOCOLS``): "inside" the compressed prompt (a cell's
            ``tasks``, ``task_mean``, ``predictions``), and/or "after" compression (the same fields under the
            cell's ``"after"`` key), each task example run under each protocol.
        after_methods: the methods that run the protocols other than "inside" (None: every method); the others'
            saved results under those protocols are dropped.
    """
    out_path = Path(out_path) if out_path else None
    settings = dict(settings or {}, methods=list(methods), retentions=list(retentions), window=window)
    if list(protocols) != ["inside"]:  # files of the one-protocol runs stay resumable
        settings["protocols"] = list(protocols)
    cells = _load_resumable(out_path, settings)
    task_examples = list(task_examples)
    full_fn = _memoized(continuation_logits_fn(model)) if fidelity_ids is not None else None
    # One prefill per fidelity example serves every method and retention that selects from the window's queries.
    shared = SharedPrefill(model, window, min(retentions)) if fidelity_ids is not None and retentions else None

    plan = []
    for method in methods:
        for retention in ([None] if is_full(method) else retentions):
            plan.append((method, retention))
    planned = {cell_key(method, retention) for method, retention in plan}
    cells = {key: cell for key, cell in cells.items() if key in planned}
    dropped = False  # stale protocol results were dropped from a saved cell: the file is rewritten without them
    for i, (method, retention) in enumerate(plan, 1):
        key = cell_key(method, retention)
        policy = make_policy(method, retention or 1.0, profile, window)
        saved = cells[key] if key in cells and same_policy(cells[key], policy) else None
        runs = [p for p in protocols if p == "inside" or after_methods is None or method in after_methods]
        if saved is not None:
            kept = _without_stale_protocols(saved, runs, policy, tokenizer)
            dropped = dropped or kept != saved
            cells[key] = saved = kept
        # A saved cell without a protocol's results (never run, or dropped as stale) runs only that protocol.
        to_run = [protocol for protocol in runs if task_examples and (
            saved is None or (protocol != "inside" and protocol not in saved))]
        if saved is not None and not to_run:
            log(f"[{i}/{len(plan)}] {key}: already in {out_path}, skipped")
            continue
        log(f"[{i}/{len(plan)}] {key}" + ("" if saved is None else f": {', '.join(to_run)} only"))
        compression = functools.partial(compress, model, policy)
        start = time.perf_counter()
        cell = (dict(saved) if saved is not None else
                {"method": method, "retention": retention, "policy": policy.name, "policy_repr": repr(policy)})
        if fidelity_ids is not None and saved is None:
            if policy.is_full:
                compressed_fn = full_fn
            elif shared.supports(policy):
                compressed_fn = shared.logits_fn(policy)
            else:
                compressed_fn = continuation_logits_fn(model, compression)
            report = evaluate_fidelity(fidelity_ids, prefix_len, full_fn, compressed_fn, progress=progress)
            # JSON has no NaN: a standard error over one example is reported as null.
            cell["fidelity"] = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                                for k, v in report.summary().items()}
            cell["fidelity"]["kl_per_example"] = report.kl
        for protocol in to_run:
            generate = protocol_generate_fn(protocol, model, tokenizer, policy)
            report = evaluate(task_examples, generate, progress=progress,
                              desc=key if protocol == "inside" else f"{key} {protocol}", protocol=protocol)
            scores = {"tasks": report.task_scores(), "task_mean": report.mean(),
                      "predictions": [{"task": r.task, "id": r.id, "prediction": r.prediction, "score": r.score}
                                      for r in report.results]}
            if protocol == "inside":
                cell.update(scores)
            else:
                cell[protocol] = dict(scores, **protocol_settings(protocol, policy, tokenizer))
        cell["seconds"] = cell.get("seconds", 0.0) + time.perf_counter() - start
        cells[key] = cell
        if out_path is not None:
            write_json_atomic(out_path, _document(settings, cells))
    if out_path is not None and dropped:
        write_json_atomic(out_path, _document(settings, cells))
    return _document(settings, cells)


def _document(settings: dict, cells: dict) -> dict:
    return {"format": FORMAT, "version": FORMAT_VERSION, "settings": settings, "cells": cells}
