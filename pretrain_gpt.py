"""Pretrain GPT / MoE models with Megatron-Core; ``--ciera-allgather`` gathers parameters with CIERA.

    torchrun --nproc-per-node 8 pretrain_gpt.py <Megatron-LM flags> --ciera-allgather

Flags: ``python pretrain_gpt.py --help`` (see megatron/ciera/app/arguments.py). The loop lives in
megatron/ciera/app/training.py.
"""

import sys


def main(argv: list[str]) -> None:
    if "-h" in argv or "--help" in argv:
        # The parser alone: --help answers without importing megatron-core's training stack.
        from megatron.ciera.app.arguments import build_parser

        build_parser().print_help()
        return
    from megatron.ciera.app.upstream_notices import silence_fallback_warnings

    silence_fallback_warnings()  # before megatron-core is imported; training says it once instead
    from megatron.ciera.app.training import main as train_main

    train_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
