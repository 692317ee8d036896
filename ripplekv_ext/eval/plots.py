"""PNG figures for the CLI: sensitivity profile, per-layer budgets, score versus retention; and the report's: KL
against retention with confidence intervals, accuracy by needle depth, needle-in-a-haystack heat maps."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    tmp.replace(path)  # never leave half a PNG behind
    _pyplot().close(fig)
    return path


def plot_profile(profile, path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(profile.layers, profile.sensitivity, yerr=profile.stderr, color="tab:blue", capsize=2)
    ax.set_xlabel("layer")
    ax.set_ylabel("sensitivity (mean KL, nats)")
    ax.set_title(f"RippleKV sensitivity profile: {profile.model['name']}")
    return _save(fig, path)


def plot_budgets(budgets: dict[str, list[int]], layers: list[int], n_tokens: int, path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, values in budgets.items():
        ax.plot(layers, values, marker="o", markersize=3, label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("tokens kept per KV head")
    ax.set_title(f"per-layer budgets for a {n_tokens}-token prompt")
    ax.legend()
    return _save(fig, path)


def plot_eval(results: dict, path) -> Path:
    """Score versus retention, one line per method: fidelity KL (left) and mean task score (right)."""
    plt = _pyplot()
    cells = list(results["cells"].values())
    panels = [("fidelity KL (nats, lower is better)", lambda c: c.get("fidelity", {}).get("kl")),
              ("mean task score (x100)", lambda c: c.get("task_mean"))]
    panels = [p for p in panels if any(p[1](c) is not None for c in cells)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4), squeeze=False)
    retentions = sorted(results["settings"]["retentions"])
    for ax, (title, value) in zip(axes[0], panels):
        for method in results["settings"]["methods"]:
            mine = [c for c in cells if c["method"] == method]
            if mine and mine[0]["retention"] is None:  # Full: one value, drawn flat across retentions
                ax.plot(retentions, [value(mine[0])] * len(retentions), "k--", label=method)
                continue
            points = sorted((c["retention"], value(c)) for c in mine if value(c) is not None)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        ax.set_xlabel("retention")
        ax.set_title(title)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _method_color(label: str):
    """One colour per method across every figure of the report (full black, the rest by method name)."""
    colors = {"full": "black", "streamingllm": "tab:gray", "h2o": "tab:brown", "snapkv": "tab:orange",
              "pyramidkv": "tab:green", "cake": "tab:purple", "ripplekv": "tab:blue"}
    return colors.get(label.split()[0], None)


def plot_kl_vs_retention(results: dict, path) -> Path:
    """Mean fidelity KL against retention, one line per method, with the 95% interval of each mean as error bars
    (log scale: the methods differ by multiples)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    cells = list(results["cells"].values())
    methods = [m for m in results["settings"]["methods"]
               if any(c["method"] == m and c["retention"] is not None for c in cells)]
    retentions = sorted({c["retention"] for c in cells if c["retention"] is not None})
    # Each method's points shifted a little sideways, so that overlapping error bars stay apart.
    step = 0.15 * min((b - a for a, b in zip(retentions, retentions[1:])), default=0.1) / max(len(methods), 1)
    for index, method in enumerate(methods):
        points = sorted((c["retention"], c["fidelity"]) for c in cells
                        if c["method"] == method and c["retention"] is not None)
        x = [r + (index - (len(methods) - 1) / 2) * step for r, _ in points]
        y = [f["kl"] for _, f in points]
        low = [f["kl"] - f["kl_ci_low"] if f.get("kl_ci_low") is not None else 0 for _, f in points]
        high = [f["kl_ci_high"] - f["kl"] if f.get("kl_ci_high") is not None else 0 for _, f in points]
        ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label=method, color=_method_color(method))
    ax.set_yscale("log")
    ax.set_xticks(retentions)
    ax.xaxis.set_major_formatter(lambda value, _: f"{value:.0%}")
    ax.set_xlabel("retention (share of the prompt's KV cache kept)")
    ax.set_ylabel("KL(full || compressed), nats/token")
    examples = results["settings"].get("examples")
    ax.set_title(f"fidelity at {results['settings'].get('prefix_len')}-token prompts "
                 f"({examples} examples, 95% CI); lower is better", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def plot_accuracy_by_depth(by_depth: dict[str, dict], path, title: str = "") -> Path:
    """Accuracy against needle depth, one line per method, with 95% Wilson intervals as error bars.

    ``by_depth``: ``{label: {depth in [0, 1]: [0/1 scores]}}``."""
    from ripplekv_ext.profiler.stats import wilson_interval

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, groups) in enumerate(by_depth.items()):
        depths = sorted(groups)
        accuracy, low, high = [], [], []
        for d in depths:
            k, n = int(round(sum(groups[d]))), len(groups[d])
            lo, hi = wilson_interval(k, n)
            accuracy.append(k / n)
            low.append(k / n - lo)
            high.append(hi - k / n)
        # A small horizontal offset per method keeps overlapping error bars apart.
        x = [100 * d + (i - (len(by_depth) - 1) / 2) * 1.2 for d in depths]
        ax.errorbar(x, accuracy, yerr=[low, high], marker="o", capsize=3, label=label, color=_method_color(label))
    ax.set_xlabel("needle depth (% of the context)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.05, 1.05)
    n = max(len(s) for groups in by_depth.values() for s in groups.values())
    ax.set_title(f"{title} (n = {n} per depth, 95% Wilson CI)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_needle_heatmaps(grids: dict[str, dict], lengths, depths, path) -> Path:
    """The needle-in-a-haystack heat maps as the field publishes them: context length on x, needle depth on y
    (0% at the top), colour = score on the 1-10 scale (red to green), one panel per method and retention.

    ``grids``: ``{label: {(length, depth_percent): score}}``."""
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    plt = _pyplot()
    # The colour map of gkamradt's published figures.
    cmap = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])
    columns = min(3, len(grids))
    rows = -(-len(grids) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns + 1, 3.0 * rows + 0.5), squeeze=False,
                             layout="constrained")
    image = None
    for ax, (label, grid) in zip(axes.flat, grids.items()):
        values = np.array([[grid.get((length, depth), np.nan) for length in lengths] for depth in depths])
        image = ax.imshow(values, cmap=cmap, vmin=1, vmax=10, aspect="auto")
        for (r, c), v in np.ndenumerate(values):
            if not np.isnan(v):
                ax.text(c, r, f"{v:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=7)
        ax.set_title(f"{label}: mean {np.nanmean(values):.1f}", fontsize=9)
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
    for ax in list(axes.flat)[len(grids):]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="score (1-10)")
    fig.suptitle("needle in a haystack (Paul Graham essays)", fontsize=10)
    return _save(fig, path)


def plot_prefill_memory(results: dict, path) -> Path:
    """One request's prefill memory against prompt length, one panel per model: peak RSS above the loaded model
    (solid) and the most KV the cache held at once (dashed), per method (bench/e2e_bounded_prefill.py's cells)."""
    plt = _pyplot()
    cells = results["cells"]
    models = list(dict.fromkeys(key.split("/")[0] for key in cells))
    methods = results["settings"]["methods"]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for index, method in enumerate(methods):
            points = sorted((int(key.split("/")[1]), cell) for key, cell in cells.items()
                            if key.split("/")[0] == model and key.split("/")[2] == method)
            if not points:
                continue
            lengths = [n for n, _ in points]
            color = f"C{index}"
            ax.plot(lengths, [c["peak_rss_above_model"] / 2**20 for _, c in points], marker="o", color=color,
                    label=f"{method}: peak RSS")
            ax.plot(lengths, [c["peak_kv_bytes"] / 2**20 for _, c in points], marker="x", linestyle="--",
                    color=color, label=f"{method}: peak KV")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("MiB above the loaded model")
        ax.set_title(model, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    settings = results["settings"]
    fig.suptitle(f"one request's prefill memory (retention {settings['retention']:.0%}, rolling chunk "
                 f"{settings['chunk']}, one thread)", fontsize=10)
    return _save(fig, path)
