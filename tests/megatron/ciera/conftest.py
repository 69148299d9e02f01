"""The Megatron binding's tests. ``flag_args`` (beside this file) is importable from every test
below it: pytest puts a ``conftest.py``'s folder on ``sys.path`` before collecting its tests."""
