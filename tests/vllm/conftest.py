"""The tiny models the plugin's engines run, as fixtures (see ``harness`` for the engines and the reference)."""

import pytest
import torch

from ripplekv_ext.engines.vllm import offline_cpu_environment  # (imports no vLLM)
from ripplekv_ext.profile_file import Profile, save_profile

# Read by vLLM when it is first imported. The engines run in this process (so the tests can read the scheduler's
# block pool), unbound to CPU cores and on one thread, with no model hub.
offline_cpu_environment()
torch.set_num_threads(1)

# Random weights with initializer_range 0.1: attention peaked enough that dropping tokens changes greedy tokens.
LLAMA_CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    initializer_range=0.1)


def save_tiny_llama(path, **changes) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA_CONFIG, **changes})).to(torch.float32).save_pretrained(
        path, safe_serialization=True)
    return str(path)


def load_reference_model(path):
    """The transformers model the engines are compared with (the same weights, float32, SDPA)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    # The engines run with ignore_eos: the reference generates every token too (random weights pick EOS now and then).
    model.generation_config.eos_token_id = None
    return model


def save_given_profile(model, sensitivity, name, folder) -> str:
    """A RippleKV profile of ``model`` with the given (made-up) sensitivities: the mechanics are under test."""
    path = folder / f"{name}.json"
    save_profile(Profile.from_sensitivity(model, sensitivity, name), path)
    return str(path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def hf_model(model_dir):
    return load_reference_model(model_dir)


@pytest.fixture(scope="session")
def profile_path(hf_model, tmp_path_factory):
    return save_given_profile(hf_model, [0.5, 0.05, 0.2, 0.01], "tiny-llama", tmp_path_factory.mktemp("profile"))
