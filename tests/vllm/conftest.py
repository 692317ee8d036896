"""The vLLM plugin's tests run only where vLLM is installed (`make test-vllm`, in .venv-vllm).

Elsewhere this folder is left out of collection without importing anything. Where vLLM is installed, the engines run
in this process (so the tests can read the scheduler's block pool), unbound to CPU cores and on one thread, with no
model hub: the model is a tiny random Llama written to a temporary folder.
"""

import importlib.util
import os

# This folder is itself importable as a namespace package "vllm" (pytest puts tests/ on sys.path): only an installed
# vLLM, a regular package, has an origin.
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    collect_ignore_glob = ["*.py"]
else:
    # Read by vLLM when it is first imported: before any test module imports it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # vLLM reports usage to its servers from a background thread; tests send nothing.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
