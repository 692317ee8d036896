"""The plugin across two vLLM "nodes" on this machine's loopback (vLLM's multiprocess executor, ``nnodes=2``): the head
runs the engine, the other node runs headless (``python -m ripplekv_ext.engines.vllm.headless``, what ``vllm serve
--headless`` runs), tensor parallel 2 and pipeline parallel 2 across them. Both run as processes of their own with a
time limit, so a node that never connects fails the test instead of hanging it. Each request's tokens equal the
single-process reference, ``compress(model, plan.policy)`` + ``generate`` on each prompt alone, with compression
while decoding in both."""

import contextlib
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from harness import BLOCK, LAYERS, NEW_TOKENS, engine_kwargs, free_port, prompts, reference, stop  # noqa: E402
from ripplekv_ext.engines import vllm as plugin  # noqa: E402
from ripplekv_ext.engines.vllm.settings import Settings  # noqa: E402
from ripplekv_ext.engines.vllm.plan import plan_for  # noqa: E402

HEAD = """
import json, sys
from ripplekv_ext.engines.vllm import offline_cpu_environment
offline_cpu_environment()
from vllm import LLM, SamplingParams
kwargs, token_lists, new_tokens = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
preempt_after = int(sys.argv[4])  # generated tokens of every running request; 0: never
llm = LLM(**kwargs)
engine = llm.llm_engine
scheduler = engine.engine_core.engine_core.scheduler
preempted = []
preempt = scheduler._preempt_request
scheduler._preempt_request = lambda request, *a, **k: (preempted.append(request.request_id),
                                                       preempt(request, *a, **k))[1]
params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
# A request aborted half-way through its prompt leaves nothing behind, on either node.
engine.add_request("aborted", {"prompt_token_ids": token_lists[-1]}, params)
engine.step()
engine.abort_request(["aborted"])
for i, tokens in enumerate(token_lists):
    engine.add_request(str(i), {"prompt_token_ids": tokens}, params)
outputs = {}
while engine.has_unfinished_requests():
    outputs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    if preempt_after and not preempted and len(scheduler.running) == len(token_lists) and all(
            r.num_output_tokens > preempt_after for r in scheduler.running):
        # Every running request back to the waiting queue: each recomputes its prompt and output on both nodes.
        assert llm.reset_prefix_cache(reset_running_requests=True)
print("TOKENS " + json.dumps([outputs[str(i)] for i in range(len(token_lists))]), flush=True)
print("PREEMPTED " + json.dumps(preempted), flush=True)
engine.engine_core.shutdown()
"""
SECONDS = 420  # each node's limit: start-up, the prompts, shut-down


def cli_flags(kwargs: dict) -> list[str]:
    """vLLM's command-line options for engine keyword arguments."""
    flags = []
    for key, value in kwargs.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags += [f"--{name}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


@contextlib.contextmanager
def headless_node(kwargs: dict, log):
    # From another folder than the checkout: `python -m` and `-c` put the working folder first on sys.path.
    node = subprocess.Popen([sys.executable, "-m", "ripplekv_ext.engines.vllm.headless", *cli_flags(kwargs)],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            cwd=os.path.dirname(log.name))
    try:
        yield node
    finally:
        stop(node, 30)


# Both compress while decoding too: every 8 generated tokens down to 48 tokens a layer on average. Under pipeline
# parallel, four requests generating 100 tokens are preempted after 30 (every one, as vLLM's reset of the prefix cache
# with running requests does) and recompute past their decode compactions (single-node pipeline parallel is this
# test's: its model compiles at start-up, a minute of CI each).
@pytest.mark.parametrize("ripplekv,parallel,lengths,new_tokens", [
    ({"method": "snapkv", "retention": 0.2, "decode_every": 8, "decode_budget": 48}, dict(tensor_parallel_size=2),
     None, NEW_TOKENS),
    ({"method": "ripplekv", "retention": 0.2, "tiers": 2, "prefill_chunk": 64, "decode_every": 8, "decode_budget": 48},
     dict(pipeline_parallel_size=2, enforce_eager=False, max_num_batched_tokens=64), [270, 300, 240, 333], 100),
], ids=["tp2-one-shot-decode", "pp2-tiers-bounded-decode-preempted"])
def test_two_nodes_give_the_single_process_tokens(model_dir, hf_model, profile_path, tmp_path, ripplekv, parallel,
                                                  lengths, new_tokens):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = prompts() if lengths is None else prompts(lengths, seed=1)
    port = free_port()
    across = dict(nnodes=2, master_addr="127.0.0.1", master_port=port, distributed_executor_backend="mp")
    head = {**engine_kwargs(model_dir, ripplekv, **parallel), **across, "node_rank": 0}
    with open(tmp_path / "node1.log", "w") as log, headless_node({**head, "node_rank": 1}, log):
        out = subprocess.run([sys.executable, "-c", HEAD, json.dumps(head), json.dumps(token_lists), str(new_tokens),
                              "0" if lengths is None else "30"],
                             capture_output=True, text=True, timeout=SECONDS, cwd=tmp_path,
                             env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1"))
    lines = [line for line in out.stdout.splitlines() if line.startswith("TOKENS ")]
    assert out.returncode == 0 and lines, (out.stderr[-3000:], (tmp_path / "node1.log").read_text()[-3000:])
    assert json.loads(lines[0][len("TOKENS "):]) == reference(hf_model, plan.policy, token_lists, new_tokens)
    preempted = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PREEMPTED "))[10:])
    assert bool(preempted) == (lengths is not None), preempted


def test_a_node_whose_plan_differs_from_the_head_s_is_refused(profile_path, tmp_path):
    """What the engine core receives from the workers of two nodes (their KV cache specs, as vLLM passes them to
    get_kv_cache_configs, which the plugin wraps): another retention, another profile file at the same path, or a
    node where the plugin is not active, each refused naming what differs; the same plan on both passes."""
    import shutil

    import torch
    from vllm.v1.engine import core as engine_core
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from ripplekv_ext.engines.vllm.kv_cache import check_workers_agree, tier_spec

    plugin.register()
    stock = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)

    def specs(ripplekv):
        plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
        return {f"model.layers.{i}.self_attn.attn": tier_spec(stock, plan, i, 1024, 512) for i in range(LAYERS)}

    head = specs({"method": "snapkv", "retention": 0.2})
    check_workers_agree([head, specs({"method": "snapkv", "retention": 0.2})])
    with pytest.raises(RuntimeError, match=r"worker 0 has settings .*\"retention\": 0.2.*worker 1 has settings "
                                           r".*\"retention\": 0.3.*start every node .*with the head's "
                                           r"--additional-config"):
        engine_core.get_kv_cache_configs(None, [head, specs({"method": "snapkv", "retention": 0.3})], [0, 0])
    copy = tmp_path / "profile.json"
    shutil.copy(profile_path, copy)
    ripplekv = {"method": "ripplekv", "retention": 0.2, "profile": str(copy)}
    first = specs(ripplekv)
    copy.write_text(copy.read_text() + "\n")  # the same path, another file (here: the same JSON, other bytes)
    with pytest.raises(RuntimeError, match=r"profile sha256 \w+\).*profile sha256 \w+\)"):
        check_workers_agree([first, specs(ripplekv)])
    with pytest.raises(RuntimeError, match=r"workers \[1\] keep stock vLLM caches .*install the same ripplekv_ext"):
        check_workers_agree([head, {name: stock for name in head}])
