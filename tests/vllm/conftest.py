"""The vLLM plugin's tests run only where vLLM is installed (`make test-vllm`, in .venv-vllm).

Elsewhere this folder is left out of collection without importing anything. Where vLLM is installed, the engines run
in this process (so the tests can read the scheduler's block pool), unbound to CPU cores and on one thread, with no
model hub: the model is a tiny random Llama written to a temporary folder.
"""

import importlib.util

# This folder is itself importable as a namespace package "vllm" (pytest puts tests/ on sys.path): only an installed
# vLLM, a regular package, has an origin.
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    collect_ignore_glob = ["*.py"]
else:
    # Read by vLLM when it is first imported: before any test module imports it.
    from ripplekv_ext.engines.vllm import offline_cpu_environment

    offline_cpu_environment()
