"""CIERA's tools: benchmarks (``bench_*.py``), the scaling simulator (``sim/``), the
network-namespace testbed (``testbed/``) and data and flag utilities.

Installed with the library (``setup.py``), so every script runs as ``python tools/<name>.py`` from
any directory and imports ``ciera``, ``megatron.ciera`` and ``tools.*`` without path set-up.
Shared helpers live in :mod:`tools._common`.
"""
