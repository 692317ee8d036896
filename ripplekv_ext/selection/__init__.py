"""Which tokens a layer keeps under its budget: the selectors (``selectors``: SnapKV, PeakSpan, KeyNorm, H2O,
StreamingLLM and ``ScoredSelector`` for a score of one's own), AdaKV's head-wise budgets inside a layer (``adakv``),
CAKE's token score (``cake``), and ``compressor`` (``KVCompressor``: selection and compaction of one layer's cache
under an explicit budget, on the compiled ops)."""
