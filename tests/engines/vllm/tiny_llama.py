"""The tiny Llama the plugin's engines serve, saved as a transformers folder, its transformers reference model, and
made-up profiles of it."""

import torch

from ripplekv_ext.budgets.profile_file import Profile, save_profile

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
