"""Isolated compression damage: does the sensitivity profile predict where compression hurts?

For every layer `l`: compress only layer `l`'s prefix cache with SnapKV at retention `r` (the last `W`
prefix queries of that layer score the prefix; the top tokens plus the window are kept), run the
continuation, and measure KL(P_ref || P_compressed) on it. Then report Spearman(|rho|) of that damage with
the sensitivity profile and with layer index: the article's diagnostic (0.799 vs 0.359 on Llama-3.1-8B).

Compression is applied by masking the evicted prefix positions out of layer `l`'s attention, which is
exactly attention over the compacted cache, and keeps every layer's cache the same length (so positions
and masks need no special handling). As in the profiler, layers before `l` replay their recorded outputs.
The masking attention enters transformers the way ``ripplekv_ext.compress`` does (the transformers integration's
``registered_attention``: a uniquely named registration for this model only), never by replacing the global "sdpa"
entry.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.budgets.allocators import average_budget
from ripplekv_ext.policies import DEFAULT_WINDOW
from ripplekv_ext.selection.selectors import SnapKVSelector
from ripplekv_ext.budgets.profile_file import Profile
from ripplekv_ext.profiler import ContinuationRunner
from ripplekv_ext.profiler.stats import spearman


class AttentionTap:
    """Wraps transformers' SDPA attention: records the last W queries of each layer on the prefix pass,
    and on continuation passes masks out the prefix positions a layer's compression evicted."""

    def __init__(self, window: int):
        self.window = window
        self.q_window: dict[int, torch.Tensor] = {}
        self.scaling: dict[int, float] = {}
        self.capture = False
        self.evict_layer: int | None = None
        self.keep: torch.Tensor | None = None  # bool [B, H_kv, P]

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        from ripplekv_ext.integrations.transformers import base_attention
        sdpa_attention_forward = base_attention("sdpa")[0]
        layer = getattr(module, "layer_idx", None)
        if self.capture and query.shape[2] >= self.window:
            self.q_window[layer] = query[:, :, -self.window:, :].detach().clone()
            self.scaling[layer] = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        if self.evict_layer is not None and layer == self.evict_layer:
            attention_mask = self._evict(query, key, attention_mask)
            kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    def _evict(self, query, key, mask):
        b, h_q, t, _ = query.shape
        h_kv, k_len = key.shape[1], key.shape[2]
        p = self.keep.shape[-1]
        keep = torch.ones(b, h_kv, k_len, dtype=torch.bool, device=key.device)
        keep[:, :, :p] = self.keep.to(key.device)
        keep = keep.repeat_interleave(h_q // h_kv, dim=1).unsqueeze(2)  # [B, H_q, 1, K]
        if mask is None:  # build the causal mask SDPA would have implied: query i sits at K - T + i
            q_pos = torch.arange(k_len - t, k_len, device=key.device).unsqueeze(-1)
            mask = torch.arange(k_len, device=key.device) <= q_pos
        mask = mask[..., -k_len:]
        if mask.dtype == torch.bool:
            return mask & keep
        return mask.masked_fill(~keep, float("-inf"))


def _tapped(model, tap: AttentionTap):
    """``model`` runs its attention through ``tap`` (with SDPA's mask) inside the block."""
    from ripplekv_ext.integrations.transformers import base_attention, registered_attention, unique_attention_name
    sdpa_mask = base_attention("sdpa")[1]
    return registered_attention(model, unique_attention_name("ripplekv_diagnostic"), tap, sdpa_mask)


def snapkv_keep_mask(q_window: torch.Tensor, keys: torch.Tensor, budget: int,
                     scale: float | None = None) -> torch.Tensor:
    """bool `[B, H_kv, N]`: True for the positions SnapKV keeps under `budget` (window included).

    The selection of ``Policy.snapkv`` (default SnapKV settings, window = the queries given), without the gather:
    the diagnostic masks instead of compacting."""
    idx = SnapKVSelector().select(q_window, keys, budget, q_window.shape[2], scale)
    keep = torch.zeros(keys.shape[:3], dtype=torch.bool, device=keys.device)
    keep.scatter_(-1, idx, True)
    return keep


def compression_damage(model, examples: torch.Tensor, prefix_len: int, layers: Sequence[int],
                       retentions: Sequence[float] = (0.2,), window: int = DEFAULT_WINDOW, reuse: bool = True,
                       progress: bool = True) -> dict[float, list[float]]:
    """Mean KL on the continuation when only layer `l` is SnapKV-compressed, per retention and layer."""
    from ripplekv_ext.integrations.transformers import attention_implementation
    implementation = attention_implementation(model)
    if implementation != "sdpa":
        raise ValueError(f"model must use attn_implementation='sdpa', got {implementation!r}")
    if not 0 < window < prefix_len:
        raise ValueError(f"window must be in [1, prefix_len = {prefix_len}), got {window}")
    budgets = {r: average_budget(r, prefix_len) for r in retentions}
    for r, c in budgets.items():
        if c <= window:
            raise ValueError(f"retention {r} keeps {c} of {prefix_len} prefix tokens; it must keep more than "
                             f"the window W = {window}")
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(examples) * len(layers) * len(retentions), desc="compression damage", unit="run")
    per_example = {r: [] for r in retentions}
    tap = AttentionTap(window)
    with torch.inference_mode(), _tapped(model, tap):
        for ids in examples:
            tap.capture, tap.evict_layer = True, None
            runner = ContinuationRunner(model, ids, prefix_len, reuse=reuse)
            tap.capture = False
            for r in retentions:
                row = []
                for l in layers:
                    cache_layer = runner.prefix_layers[l]
                    tap.keep = snapkv_keep_mask(tap.q_window[l], cache_layer.keys, budgets[r],
                                                scale=tap.scaling[l])
                    tap.evict_layer = l
                    try:
                        row.append(runner.kl_from_ref(runner.run(l)))
                    finally:
                        tap.evict_layer = None
                    if bar:
                        bar.update()
                per_example[r].append(row)
    if bar:
        bar.close()
    return {r: np.asarray(rows).mean(axis=0).tolist() for r, rows in per_example.items()}


def damage_report(profile: Profile, damage: dict[float, list[float]], extra: dict | None = None) -> dict:
    """Spearman |rho| of damage with the profile and with layer index, per retention and on average."""
    layers = list(profile.layers)
    rows = {}
    for r, d in damage.items():
        if len(d) != len(layers):
            raise ValueError(f"damage for retention {r} must have one value per profiled layer ({len(layers)}), "
                             f"got {len(d)}")
        rho_profile, rho_index = spearman(d, profile.sensitivity), spearman(d, layers)
        rows[str(r)] = {"damage": list(map(float, d)), "spearman_profile": rho_profile, "spearman_index": rho_index}

    def mean_abs(key):
        vals = [abs(v[key]) for v in rows.values() if v[key] is not None]
        return float(np.mean(vals)) if vals else None
    return {"model": profile.model["name"], "layers": layers, "sensitivity": list(profile.sensitivity),
            "retentions": rows, "mean_abs_spearman_profile": mean_abs("spearman_profile"),
            "mean_abs_spearman_index": mean_abs("spearman_index"), **(extra or {})}


def run_diagnostic(model, profile: Profile, examples: torch.Tensor, prefix_len: int,
                   retentions: Sequence[float] = (0.1, 0.2, 0.3), window: int = DEFAULT_WINDOW, out_path=None,
                   progress: bool = True) -> dict:
    """Damage of compressing each profiled layer alone, correlated with the profile; saved as JSON."""
    start = time.perf_counter()
    damage = compression_damage(model, examples, prefix_len, profile.layers, retentions, window, progress=progress)
    report = damage_report(profile, damage, {
        "num_examples": int(examples.shape[0]), "prefix_len": prefix_len,
        "cont_len": int(examples.shape[1]) - prefix_len, "window": window, "selector": "snapkv",
        "seconds": time.perf_counter() - start})
    if out_path:
        write_json_atomic(out_path, report)
    return report


def format_report(report: dict) -> str:
    rets = list(report["retentions"])
    head = f"{'layer':>5}  {'sensitivity':>12}  " + "  ".join(f"{'damage r=' + r:>14}" for r in rets)
    lines = [head]
    for i, l in enumerate(report["layers"]):
        lines.append(f"{l:>5}  {report['sensitivity'][i]:12.4g}  "
                     + "  ".join(f"{report['retentions'][r]['damage'][i]:14.4g}" for r in rets))

    def fmt(x):
        return "n/a" if x is None else f"{x:+.3f}"
    for r in rets:
        v = report["retentions"][r]
        lines.append(f"r={r}: Spearman(damage, profile) {fmt(v['spearman_profile'])}, "
                     f"Spearman(damage, layer index) {fmt(v['spearman_index'])}")
    mp, mi = report["mean_abs_spearman_profile"], report["mean_abs_spearman_index"]
    lines.append(f"mean |Spearman|: profile {fmt(mp)}, layer index {fmt(mi)}  (article, Llama-3.1-8B: 0.799 vs 0.359)")
    return "\n".join(lines)
