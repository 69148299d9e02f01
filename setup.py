"""Install CIERA-Megatron: the ``ciera`` library and its Megatron-Core binding ``megatron.ciera``.

``megatron`` is a namespace package owned by megatron-core, so ``megatron.ciera`` is installed
without a ``megatron/__init__.py`` (one would hide ``megatron.core``). ``tools`` (benchmarks,
simulator, testbed) is installed too, so its scripts import ``ciera`` and each other as packages.

The native CPU codecs (``ciera/native/csrc``, plain C11 + OpenMP, no Python or torch headers) are
built here as an *optional* extension: without a working C compiler the install still succeeds and
the codecs fall back to their pure-torch references (``ciera.native`` logs why).

Torch is not pinned here: GPU clusters bring their own build. The ``cpu`` extra pins the CPU
build used on development machines and CI. ``make demo`` installs ``.[cpu,plots]`` (the demos,
launch scripts and tools); ``make setup`` / ``make test`` add ``triton`` and ``dev`` (the tests).
"""

from glob import glob

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext


class BuildNative(build_ext):
    """Builds ``ciera.native._ciera_codecs`` with OpenMP and the x86-64-v3 / AVX2 paths; where the
    compiler lacks them, without the CPU-specific paths (``-DCIERA_NO_CLONES``), then also without
    OpenMP (one thread per call). Every variant writes the same bytes."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
            return
        except Exception as e:
            print(f"ciera.native: build failed ({e}); retrying without the CPU-specific paths")
        ext.extra_compile_args = [*ext.extra_compile_args, "-DCIERA_NO_CLONES"]
        try:
            super().build_extension(ext)
        except Exception as e:  # no OpenMP: one thread per call, same bytes
            print(f"ciera.native: OpenMP build failed ({e}); building single-threaded")
            ext.extra_compile_args = [*(a for a in ext.extra_compile_args if a != "-fopenmp"), "-Wno-unknown-pragmas"]
            ext.extra_link_args = [a for a in ext.extra_link_args if a != "-fopenmp"]
            super().build_extension(ext)


NATIVE = Extension(
    "ciera.native._ciera_codecs",
    sources=sorted(glob("ciera/native/csrc/*.c")),  # one file per job; ciera_codecs.h is the interface
    depends=sorted(glob("ciera/native/csrc/*.h")),
    extra_compile_args=["-std=c11", "-O3", "-fopenmp", "-fno-strict-aliasing", "-fvisibility=hidden"],
    extra_link_args=["-fopenmp"],
    optional=True,
)

setup(
    name="ciera-megatron",
    version="0.1.0",
    description="Lossless compressed parameter all-gather (CIERA) for Megatron-Core MoE training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # tools: the benchmarks, simulator and testbed import each other as ``tools.*`` (run as
    # ``python tools/x.py`` from anywhere, no path set-up); their data files stay in the checkout.
    packages=find_namespace_packages(include=["ciera", "ciera.*", "megatron.ciera", "megatron.ciera.*",
                                              "tools", "tools.sim", "tools.testbed"]),
    py_modules=["pretrain_gpt"],
    ext_modules=[NATIVE],
    cmdclass={"build_ext": BuildNative},
    package_data={"megatron.ciera.app": ["upstream_flags*.json"]},  # the upstream flag tables the parser reads
    install_requires=[
        "torch>=2.4",
        # The tested releases (0.16.1 and 0.19.2); the binding's version gates refuse others by name.
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "psutil",  # megatron-core's dist_checkpointing writer needs it
        "einops",  # megatron-core's Megatron-FSDP (--use-megatron-fsdp) builds its device meshes with it
    ],
    extras_require={
        # The CPU build that lies on the development machines' disk; GPU users skip this extra.
        "cpu": ["torch==2.13.0"],
        "triton": ["triton>=3.0"],
        "gpu": ["transformer-engine[pytorch]"],
        "plots": ["matplotlib"],
        # What the tests need besides triton (whose interpreter runs the kernel tests on CPU).
        # transformers: --tokenizer-type GPT2BPETokenizer / HuggingFaceTokenizer; tiktoken and sentencepiece:
        # TikTokenizer and the SentencePiece (Llama 2) tokenizers (megatron-core's own classes).
        "dev": ["pytest>=8", "hypothesis>=6", "matplotlib", "tensorboard", "wandb", "transformers", "tiktoken",
                "sentencepiece"],
        "logging": ["tensorboard", "wandb"],
        # ciera.integrations.torchtitan (examples/torchtitan): torchtitan's own trainer. Its datasets pin
        # downgrades transformers 5's huggingface_hub, so .ci/run installs it into .venv with --no-deps.
        "torchtitan": ["torchtitan==0.3.0"],
        # Peers in tools/bench_codec.py (optional rows): ZipNN and zstd.
        "peers": ["zipnn", "zstandard"],
    },
)
