"""A profile as a table for the terminal."""

from __future__ import annotations

from ripplekv_ext.budgets.profile_file import Profile


def format_profile(profile: Profile) -> str:
    """The profile's settings, one line per layer (sensitivity, standard error), its stability and its cost."""
    lines = [f"profile of {profile.model['name']} ({profile.calibration['num_examples']} examples, "
             f"P={profile.calibration['prefix_len']}, T={profile.calibration['cont_len']}, "
             f"target={profile.method['target']}, sigma={profile.method['sigma']})",
             f"{'layer':>5}  {'sensitivity':>12}  {'stderr':>10}"]
    for l, s, se in zip(profile.layers, profile.sensitivity, profile.stderr):
        lines.append(f"{l:>5}  {s:12.6g}  {se:10.3g}")
    rho = profile.stability["split_half_spearman"]
    lines.append(f"split-half Spearman: {'n/a' if rho is None else f'{rho:.3f}'}; "
                 f"wall time {profile.cost['seconds']:.1f} s on {profile.cost['device']}; "
                 f"reuse of hidden states: {profile.cost['reuse_hidden_states']}")
    return "\n".join(lines)
