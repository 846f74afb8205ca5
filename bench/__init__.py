"""Benchmarks of plug_asgd against Lightning DDP and a single process (``python -m bench all --quick``)."""
