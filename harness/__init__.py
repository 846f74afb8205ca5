"""Process and link tooling that the benchmarks (``bench``) and the tests (``tests``) share.

``harness.ports``: blocks of free ports below the ephemeral range, picked apart per pytest-xdist worker.
``harness.processes``: starting a command in its own process group, and ending all of that group.
``harness.netns``: emulated hosts, Linux network namespaces on a bridge with rate-capped links (root).

Neither ``plug_asgd`` nor its wheel contains this package (``pyproject.toml`` packages ``plug_asgd*`` only); it is
imported from the repository's root, where ``pytest`` and ``python -m bench ...`` run.
"""
