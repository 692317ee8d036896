"""The serving benchmarks' own bookkeeping, checked without vLLM (their engines run in the vLLM environment)."""

import e2e_bounded_prefill_vllm
from e2e_serving_vllm import Workload, longest_sequence, make_workload, parse_args


def test_an_engine_s_max_model_len_covers_a_chat_s_last_turn_as_the_answers_grow_it():
    # Play every conversation out with answers of exactly their new tokens: the longest sequence an engine sees is
    # what longest_sequence sized it for.
    args = parse_args(["--workload", "chat", "--conversations", "3", "--turns-min", "2", "--turns-max", "4",
                       "--document-len", "50", "--prompt-min", "5", "--prompt-max", "9", "--new-min", "3",
                       "--new-max", "7"])
    workload = make_workload(100, args)
    seen, pending = [], list(workload.first)
    while pending:
        request = pending.pop()
        _, prompt, new = request
        seen.append(len(prompt) + new)
        pending += workload.after(request, [0] * new)
    assert len(seen) > len(workload.first)
    assert longest_sequence(workload) == max(seen)
    plain = Workload([("0", [1] * 30, 4), ("1", [1] * 10, 40)])
    assert longest_sequence(plain) == 50


def test_the_bounded_prefill_benchmark_sends_workloads_and_bounds_decoding_where_the_pool_is_short(monkeypatch):
    args = e2e_bounded_prefill_vllm.build_parser().parse_args([])
    settings = e2e_bounded_prefill_vllm.settings_of(args)
    assert settings["stock"] is None
    bounded = settings["rolling-decode"]
    assert {"prefill_chunk", "decode_every", "decode_budget"} <= set(bounded)
    sent = []
    monkeypatch.setattr(e2e_bounded_prefill_vllm, "run", lambda model, workload, args, ripplekv: sent.append(
        workload) or {"generated_tokens": args.new, "min_free_blocks": 1, "seconds": 0.0})
    assert e2e_bounded_prefill_vllm.completes("model", 64, args, bounded)["completes"]
    assert isinstance(sent[0], Workload) and longest_sequence(sent[0]) == 64 + args.new
