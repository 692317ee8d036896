"""Running other functions in place of a model's decoder-layer forwards.

The profiler replays recorded layer outputs instead of recomputing the layers below the perturbed one; it does so
by giving those layer instances a `forward` of its own for the duration of one call.
"""

from __future__ import annotations

import contextlib


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
