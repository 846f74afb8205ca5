import sys

if sys.argv[1:2] == ["slowlink"]:  # its own flags and hosts (bench.slowlink): not one of the runner's benchmarks
    from bench.slowlink import main as slowlink

    sys.exit(slowlink(sys.argv[2:]))

if sys.argv[1:2] == ["exchange"]:  # one process, fits alternated (bench.exchange): not one of the runner's launches
    from bench.exchange import main as exchange

    sys.exit(exchange(sys.argv[2:]))

if sys.argv[1:2] == ["gpu"]:  # a GPU's worker against plain Lightning (bench.gpu)
    from bench.gpu import main as gpu

    sys.exit(gpu(sys.argv[2:]))

from bench.runner import main

sys.exit(main())
