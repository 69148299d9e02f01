"""The flag tests' one way to parse and validate a command line (``ValueError`` on a refusal,
where ``arguments.parse_args`` would exit through argparse)."""

from megatron.ciera.app import arguments, flag_table

TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
              "--lr", "1e-4", "--micro-batch-size", "2", "--train-iters", "5", "--mock-data",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--bf16"]
"""A tiny model's flags, without the data-parallel engine's."""


def parse_and_validate(argv: list[str], *, world: int, **validate_kw):
    parser = arguments.build_parser()
    args = parser.parse_args(argv)
    args.explicit = arguments.explicit_dests(parser, argv)
    return arguments.validate_args(args, world_size=world, **validate_kw)


def async_save_flags(*, persistent: bool = True) -> list[str]:
    """``--async-save`` as the installed megatron-core's Megatron-LM runs it: with the persistent
    worker (0.19 saves synchronously without it), and on 0.19 megatron-core's own writer
    (``--async-strategy mcore``, which upstream's default, nvrx, also runs here)."""
    has_strategy = any(flag["dest"] == "async_strategy" for flag in flag_table.upstream_flags())
    return ["--async-save", *(["--use-persistent-ckpt-worker"] if persistent else []),
            *(["--async-strategy", "mcore"] if has_strategy else [])]
