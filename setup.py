"""Install CIERA-Megatron: the ``ciera`` library and its Megatron-Core binding ``megatron.ciera``.

``megatron`` is a namespace package owned by megatron-core, so ``megatron.ciera`` is installed
without a ``megatron/__init__.py`` (one would hide ``megatron.core``).

Torch is not pinned here: GPU clusters bring their own build. The ``cpu`` extra pins the CPU
build used on development machines and CI (``pip install -e '.[cpu,dev]'``).
"""

from setuptools import find_namespace_packages, setup

setup(
    name="ciera-megatron",
    version="0.1.0",
    description="Lossless compressed parameter all-gather (CIERA) for Megatron-Core MoE training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["ciera", "ciera.*", "megatron.ciera", "megatron.ciera.*"]),
    py_modules=["pretrain_gpt"],
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "numpy",
        "psutil",  # megatron-core's dist_checkpointing writer needs it
    ],
    extras_require={
        # The CPU build that lies on the development machines' disk; GPU users skip this extra.
        "cpu": ["torch==2.13.0"],
        "triton": ["triton>=3.0"],
        "gpu": ["transformer-engine[pytorch]"],
        "plots": ["matplotlib"],
        "dev": ["pytest>=8", "hypothesis>=6", "matplotlib", "tensorboard", "wandb"],
        "logging": ["tensorboard", "wandb"],
    },
)
