"""A 2-node Lightning job with one PS shard per node, on 2 emulated hosts (harness/netns.py: root).

``python tests/scripts/per_node_launch.py --out DIR``: hosts n0 and n1, one process of
tests/scripts/per_node_fit.py on each (NODE_RANK, MASTER_ADDR = n0's address), as bench/slowlink.py launches
its 2-node jobs; ``--script`` runs another fit script so (its own arguments after ``--``). Writes DIR/hosts.json
(each host's address, the main port, and each host's interface counters before and after the job) and each node's
log DIR/node{I}.log; exits 0 once both nodes exited 0, 1 otherwise (the logs' tails printed).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # harness, run as a script from anywhere

from harness.netns import DEVICE, Topology  # noqa: E402
from harness.processes import child_env, start, stop  # noqa: E402

MASTER_PORT = 29500  # each host is its own namespace: a fixed port clashes with nothing
SCRIPT = Path(__file__).with_name("per_node_fit.py")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--script", type=Path, default=SCRIPT)
    parser.add_argument("fit_args", nargs="*", help="after --: more arguments of per_node_fit.py")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    nodes = ["n0", "n1"]
    with Topology(nodes, None, tag=f"{__import__('os').getpid()}p") as topo:
        hosts = {"addresses": [topo.hosts[n].address for n in nodes], "master_port": MASTER_PORT,
                 "counters_before": topo.counters()}
        (args.out / "hosts.json").write_text(json.dumps(hosts))
        procs = []
        try:
            for rank, name in enumerate(nodes):
                env = child_env(OMP_NUM_THREADS="1", MASTER_ADDR=topo.hosts["n0"].address,
                                MASTER_PORT=str(MASTER_PORT), NODE_RANK=str(rank), WORLD_SIZE=str(len(nodes)),
                                GLOO_SOCKET_IFNAME=DEVICE)
                procs.append(start([*topo.hosts[name].prefix, sys.executable, str(args.script),
                                    "--nodes", str(len(nodes)),
                                    "--out", str(args.out), *args.fit_args], env=env, log=args.out / f"node{rank}.log"))
            codes = []
            for p in procs:
                try:
                    codes.append(p.wait(timeout=args.timeout))
                except Exception:
                    codes.append(None)
        finally:
            for p in procs:
                stop(p)
        hosts["counters_after"] = topo.counters()
        (args.out / "hosts.json").write_text(json.dumps(hosts))
    if codes != [0] * len(nodes):
        for rank in range(len(nodes)):
            print(f"--- node {rank} (exit {codes[rank]}) ---\n" + (args.out / f"node{rank}.log").read_text()[-3000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
