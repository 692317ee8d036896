"""PNG figures for the CLI: sensitivity profile, per-layer budgets, score versus retention."""

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
