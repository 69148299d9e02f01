"""pretrain_gpt.py with extra flags on some ranks (tests of the start-up agreement).

    PER_RANK_FLAGS='1:--train-iters 3' torchrun ... per_rank_pretrain.py FLAGS...
"""

import os
import shlex
import sys

if __name__ == "__main__":
    extra = dict(item.split(":", 1) for item in os.environ.get("PER_RANK_FLAGS", "").split(";") if item)
    from megatron.ciera.app.training import main

    print(f"per_rank_pretrain: rank {os.environ['RANK']} pid {os.getpid()}", flush=True)

    main(sys.argv[1:] + shlex.split(extra.get(os.environ["RANK"], "")))
