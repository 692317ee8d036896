"""The tiny models the plugin's engines run, as fixtures (see ``harness`` for the engines and the reference)."""

import pytest
import torch

from ripplekv_ext.engines.vllm import offline_cpu_environment  # (imports no vLLM)
from tiny_llama import load_reference_model, save_given_profile, save_tiny_llama

# Read by vLLM when it is first imported. The engines run in this process (so the tests can read the scheduler's
# block pool), unbound to CPU cores and on one thread, with no model hub.
offline_cpu_environment()
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def hf_model(model_dir):
    return load_reference_model(model_dir)


@pytest.fixture(scope="session")
def profile_path(hf_model, tmp_path_factory):
    return save_given_profile(hf_model, [0.5, 0.05, 0.2, 0.01], "tiny-llama", tmp_path_factory.mktemp("profile"))
