"""The whole path on a GPU: ``compress()`` on a model that lives on CUDA keeps what the same model keeps on the CPU.

The op tests check every CUDA kernel against the reference one op at a time; this checks that the hook drives them
end to end on CUDA tensors (prefill, per-layer selection, gather, decode over a compressed cache, left-padded
batches) and lands on the CPU's decisions. fp32 on both sides, so the scores agree to rounding: kept token sets
are compared per layer and must match except where two tokens' scores tie to rounding (allowed: at most 1% of
kept slots), and the greedy tokens must be identical up to the first step where the CPU's two best logits were a
near tie (a difference of rounding then picks either). Skipped without a CUDA build and device.
"""

import dataclasses

import pytest
import torch

from ripplekv_ext import Policy, compress
from ripplekv_ext.eval.tiny_models import tiny_model

from devices import requires_cuda

pytest.importorskip("transformers")
pytestmark = requires_cuda

WINDOW = 8
NEW_TOKENS = 12
NEAR_TIE = 1e-3  # logits this close: CPU and GPU rounding may order them either way


def _policy(method: str, num_layers: int) -> Policy:
    sensitivity = [1.0 + ((7 * i) % 5) * 0.4 for i in range(num_layers)]
    return {
        "snapkv": Policy.snapkv(0.3, window=WINDOW),
        "ripplekv": Policy.ripplekv(sensitivity, 0.3, window=WINDOW),
        "h2o": Policy.h2o(0.3, window=WINDOW),
        "streamingllm": Policy.streamingllm(0.3, window=WINDOW),
    }[method]


@torch.no_grad()
def _generate(model, policy, ids, mask, new_tokens=NEW_TOKENS):
    kept = {}

    def record(step):  # the prefill's selection (decode-time re-selections come later and are not recorded)
        if step.indices is not None and step.layer_idx not in kept:
            kept[step.layer_idx] = step.indices.cpu()

    with compress(model, policy, on_compress=record):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    scores = torch.stack(out.scores, dim=1).float().cpu()  # [B, new, vocab]
    return out.sequences[:, ids.shape[1]:].cpu(), kept, scores


def _assert_same_tokens(cuda_tokens, cpu_tokens, cpu_scores):
    """Equal, or equal up to a step where the CPU itself had a near tie (then the rest of that row may differ)."""
    for row in range(cpu_tokens.shape[0]):
        differ = (cuda_tokens[row] != cpu_tokens[row]).nonzero()
        if len(differ) == 0:
            continue
        step = differ[0].item()
        top2 = cpu_scores[row, step].topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < NEAR_TIE, (f"row {row}: CUDA picks token {cuda_tokens[row, step].item()} at step {step}, the "
                                f"CPU {cpu_tokens[row, step].item()}, whose logit leads by {gap:.4g} (not a tie)")


def _left_padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, n - length:] = torch.randint(3, 512, (length,), generator=g)
        mask[row, n - length:] = 1
    return ids, mask


@pytest.mark.parametrize("lengths", [(160,), (160, 90, 130)], ids=["one-prompt", "left-padded-batch"])
@pytest.mark.parametrize("method", ["snapkv", "ripplekv", "h2o", "streamingllm"])
def test_compress_on_cuda_keeps_what_cpu_keeps(method, lengths):
    model = tiny_model("llama", num_layers=4)
    policy = _policy(method, 4)
    ids, mask = _left_padded(lengths)
    cpu_tokens, cpu_kept, cpu_scores = _generate(model, policy, ids, mask)
    model.to("cuda")
    cuda_tokens, cuda_kept, _ = _generate(model, policy, ids.cuda(), mask.cuda())

    assert sorted(cuda_kept) == sorted(cpu_kept) and cpu_kept, "every compressed layer must report once"
    for layer, expected in cpu_kept.items():
        got = cuda_kept[layer]
        assert got.shape == expected.shape, f"layer {layer}: kept shape {tuple(got.shape)} vs {tuple(expected.shape)}"
        differing = (got.sort(-1).values != expected.sort(-1).values).sum().item()
        assert differing <= max(1, expected.numel() // 100), f"layer {layer}: {differing} kept slots differ"
    _assert_same_tokens(cuda_tokens, cpu_tokens, cpu_scores)


@pytest.mark.parametrize("lengths", [(160,), (160, 90, 130)], ids=["one-prompt", "left-padded-batch"])
def test_decode_time_compression_on_cuda_generates_what_cpu_generates(lengths):
    """Re-selection every 16 generated tokens over 80 tokens: five decode-time selections per layer."""
    model = tiny_model("llama", num_layers=4)
    policy = dataclasses.replace(_policy("ripplekv", 4), decode_every=16)
    ids, mask = _left_padded(lengths, seed=1)
    cpu_tokens, _, cpu_scores = _generate(model, policy, ids, mask, new_tokens=80)
    model.to("cuda")
    cuda_tokens, _, _ = _generate(model, policy, ids.cuda(), mask.cuda(), new_tokens=80)
    _assert_same_tokens(cuda_tokens, cpu_tokens, cpu_scores)
