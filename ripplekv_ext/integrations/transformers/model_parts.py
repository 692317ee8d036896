"""How a transformers model is built: its decoder layers, where its inputs go, and running other functions in
place of its decoder-layer forwards.

The profiler replays recorded layer outputs instead of recomputing the layers below the perturbed one; it does so
by giving those layer instances a `forward` of its own for the duration of one call.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["decoder_layers", "forwards_replaced", "input_device"]


def decoder_layers(model):
    """The model's list of decoder layers, or None when it cannot be found."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "model.language_model.layers"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    return None


def input_device(model) -> torch.device:
    """Where the model's input ids go: its embedding's device, or, when accelerate offloads the embedding (its
    weight then sits on "meta"), the device the offload hook runs it on (accelerate keeps that hook in the
    module's ``_hf_hook``; it has no public accessor)."""
    embedding = model.get_input_embeddings()
    hook = getattr(embedding, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    return embedding.weight.device


@contextlib.contextmanager
def forwards_replaced(replacements: dict):
    """Layers run the given functions instead of their forward inside the block.

    An instance attribute shadows the class's forward. accelerate's offload hooks are themselves an instance
    `forward`, so the one in place is put back afterwards rather than deleted."""
    saved = {module: module.__dict__.get("forward") for module in replacements}
    for module, forward in replacements.items():
        module.forward = forward
    try:
        yield
    finally:
        for module, forward in saved.items():
            if forward is None:
                del module.forward
            else:
                module.forward = forward
