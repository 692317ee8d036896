"""How a selection is compared with the reference's, for the tests and the benchmarks."""

import torch

# Scores are fp32 whatever the input dtype (inputs are upcast exactly): one tolerance serves all dtypes; it covers
# the different summation order of the tiled kernels.
SCORE_TOL = dict(rtol=1e-5, atol=1e-5)


def assert_same_selection(idx, idx_ref, scores_ref, window, tolerance=SCORE_TOL):
    """Indices must be identical, except where two scores are equal within ``tolerance``: there the kernel's fp32
    summation order may legitimately flip a near-tie at the selection threshold. Every row must be strictly ascending
    (a repeated index would drop a token that a comparison of sets cannot see), after the -1 pads of a padded batch's
    shorter rows, which come first; window positions (``>= scores_ref.shape[-1]``) are never traded."""
    assert idx.shape == idx_ref.shape and idx.dtype == torch.int64, (idx.shape, idx_ref.shape, idx.dtype)
    assert bool((idx >= -1).all()), "indices must be positions, or -1 in pad slots"
    before, after = idx[..., :-1], idx[..., 1:]
    assert bool(((before < 0) | (after > before)).all()), "indices must be strictly ascending within each row"
    if torch.equal(idx, idx_ref):
        return
    n_prefix = scores_ref.shape[-1]
    for row in range(idx.shape[0] * idx.shape[1]):
        a, b = idx.flatten(0, 1)[row].tolist(), idx_ref.flatten(0, 1)[row].tolist()
        if a == b:
            continue
        s = scores_ref.flatten(0, 1)[row].float().cpu()
        ours_only = sorted(set(a) - set(b))
        ref_only = sorted(set(b) - set(a))
        assert all(j < n_prefix for j in ours_only + ref_only), "window positions must always be kept"
        for j_ours, j_ref in zip(ours_only, ref_only):
            assert torch.isclose(s[j_ours], s[j_ref], **tolerance), (row, j_ours, j_ref, s[j_ours], s[j_ref])
