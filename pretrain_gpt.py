"""Pretrain GPT / MoE models with Megatron-Core; ``--ciera-allgather`` gathers parameters with CIERA.

    torchrun --nproc-per-node 8 pretrain_gpt.py <Megatron-LM flags> --ciera-allgather

Flags: ``python pretrain_gpt.py --help`` (see megatron/ciera/arguments.py). The loop lives in
megatron/ciera/training.py.
"""

import sys

from megatron.ciera.training import main

if __name__ == "__main__":
    main(sys.argv[1:])
