"""``python -m bench NAME [options]``: one command per benchmark (bench/results/README.md lists them with their
figures). A NAME below runs that module's own ``main``; any other name is one of the runner's benchmarks against
DDP and one process (``all``, ``stragglers``, ``overhead``, ...: :mod:`bench.runner`)."""

import importlib
import sys

from plug_asgd.startup import gc_paused

# name: the module whose own flags (and hosts, processes, device) it takes; not one of the runner's launches
MODULES = {
    "slowlink": "bench.slowlink",  # emulated hosts on capped links (root); --push-cost, --push-timing: a push's time
    "exchange": "bench.exchange",  # one process, fits alternated: a worker's step against plain Lightning
    "gpu": "bench.gpu",  # a GPU's worker against plain Lightning, and four sharing the device
    "momentum": "bench.momentum",  # modes x optimizers against DDP; --remedy, --stability
    "flood": "bench.flood",  # a PS under a flood of connections and forged messages
    "shard_ingest": "bench.shard_ingest",  # a sharded PS's ingest over capped links (root)
    "ps_floor": "bench.ps_floor",  # the PS's round trip against a minimal server of its protocol
    "standby": "bench.standby",  # the recipe's samples/s with a hot standby against without one
    "kernels": "bench.kernels",  # each codec pass in C against numpy's, alone on one core
    "islands": "bench.islands",  # per-device workers against islands of 2 against DDP on emulated hosts (root)
    "diloco": "bench.diloco",  # the language model: DDP, diloco, async_diloco, hivemind on emulated hosts (root)
    "learning": "bench.learning",  # every mode x {recipe CNN, language model}: final loss and accuracy against DDP
    "async_sim": "bench.diloco_async_sim",  # async_diloco's outer update simulated in one process: its swing
    "startup": "bench.startup",  # a worker's import of Lightning with the cycle collector on and paused
}


def main(argv: list[str]) -> int:
    named = bool(argv[:1]) and argv[0] in MODULES
    with gc_paused():  # the benchmark's imports (torch and Lightning, for most) without the collector's passes
        module = importlib.import_module(MODULES[argv[0]] if named else "bench.runner")
    return module.main(argv[1:] if named else argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
