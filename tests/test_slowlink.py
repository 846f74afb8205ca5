"""bench.slowlink at its CI size: emulated hosts on 100 Mbit/s links, checked against figures computed here."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench.slowlink import CONFIGS, SIZES, _run_spec, host_cores, pinned
from tests.conftest import PYTHON, needs_fashion, require_emulated_hosts, run_on_emulated_hosts

SLOWLINK_QUICK_TIMEOUT_S = 360  # measured: 45 s on 2 cores (3 launches of about 12-15 s, with start-up)
# the recipe CNN's float32 parameters (plug_asgd/recipes/mnist.py: 1,199,882), written out rather than computed
MODEL_BYTES = 4 * 1_199_882
BATCH = 32


@pytest.fixture(scope="module")
def can_make_hosts():
    """Namespaces, veths, a bridge and htb can be made here (root, iproute2); else skip, or fail in CI."""
    require_emulated_hosts(100.0, "t")


def test_each_configuration_is_a_run_of_its_scheme(monkeypatch):
    runs = {name: _run_spec(name, SIZES["full"], "tcp://10.99.0.1:2223") for name in CONFIGS if name != "hivemind"}
    assert runs["ddp"]["kind"] == "ddp" and "max_time_s" in runs["ddp"] and "time_limit_s" not in runs["ddp"]
    for name in ("asgd", "adacomp", "topk", "powersgd", "localsgd"):
        assert runs[name]["shm_pushes"] is False, name  # between hosts nothing is shared
        assert runs[name]["options"]["ps_address"] == "tcp://10.99.0.1:2223"
    assert runs["topk"]["compressor"] == "topk" and runs["localsgd"]["mode"] == "localsgd"
    # the PS's own flags go to serve-ps, not to the workers' run
    assert runs["adacomp-0.0033-down"]["compression"] == 0.0033 and "ps_args" not in runs["adacomp-0.0033-down"]
    assert CONFIGS["adacomp-0.0033-down"]["ps_args"] == ["--downlink-fraction", "0.01"]
    assert runs["powersgd-down"]["compressor"] == "powersgd" and "ps_args" not in runs["powersgd-down"]
    assert CONFIGS["powersgd-down"]["ps_args"] == ["--downlink-fraction", "0.01"]
    # a configuration's own knobs go to the workers' strategy beside the PS's address, which the bench sets
    every2 = runs["adacomp-0.0033-overlap-every2"]["options"]
    assert every2 == {"push_every": 2, "ps_address": "tcp://10.99.0.1:2223", "ps_insecure": True}
    assert "push_every" not in CONFIGS["adacomp-0.0033-overlap-every4"] and runs["adacomp"]["options"] == {
        "ps_address": "tcp://10.99.0.1:2223", "ps_insecure": True}
    from bench.train import make_strategy

    monkeypatch.setenv("MASTER_PORT", "29500")  # (bench.train's launch sets it: the PS's port is above it)
    strategy = make_strategy(runs["adacomp-0.0033-overlap-every4"], 0, [runs["adacomp-0.0033-overlap-every4"]])
    assert (strategy.mode.name, strategy.mode.push_every, strategy.mode.overlap) == ("adacomp", 4, True)
    assert set(CONFIGS) - set(SIZES["full"]["configs"]) == {"adacomp-0.0033-overlap-every2",
                                                            "adacomp-0.0033-overlap-every4"}  # named, not swept


def test_pinned_hosts_get_cores_of_their_own(monkeypatch):
    assert host_cores(SIZES["full"], 0) is None and pinned(["ip"], None) == ["ip"]  # not pinned: all cores shared
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    one = {"cores_per_host": 1}
    assert (host_cores(one, 0), host_cores(one, 1), host_cores(one, None)) == ([0], [1], None)  # the PS floats
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    two = {"cores_per_host": 2}
    assert (host_cores(two, 0), host_cores(two, 1), host_cores(two, None)) == ([0, 1], [2, 3], [4, 5, 6, 7])
    assert pinned(["ip", "netns", "exec", "h"], [2, 3]) == ["ip", "netns", "exec", "h", "taskset", "-c", "2,3"]
    with pytest.raises(ValueError, match="at most 4"):
        host_cores({"cores_per_host": 5}, 1)


@pytest.mark.integration
def test_a_pinned_command_runs_on_its_cores_only():
    out = subprocess.run([*pinned([], [0]), PYTHON, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[0]"


# The full tier's (pytest -m full): 3 launches on emulated hosts, 80 to 120 s of both cores in a suite run. The
# suite checks the same on smaller runs: tests/test_islands.py's two emulated hosts (a host's link counters against
# the strategy's own count of its bytes), tests/test_namespaces.py's fits across namespaces, each codec's push bytes
# against its formula on the recipe's runs (tests/test_training.py) and the configurations above.
@needs_fashion
@pytest.mark.integration
@pytest.mark.full
@pytest.mark.timeout(SLOWLINK_QUICK_TIMEOUT_S + 60)
def test_quick_slowlink_measures_the_link_and_the_bytes_each_scheme_moves(can_make_hosts, tmp_path):
    rc, output = run_on_emulated_hosts([PYTHON, "-m", "bench.slowlink", "--quick", "--out", str(tmp_path)],
                                       timeout=SLOWLINK_QUICK_TIMEOUT_S)
    assert rc == 0, output[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "results.md").exists()
    rate = results["rates"]["100"]
    # TCP transfers crossing two 100 Mbit/s htb links: none past the cap, so the cap holds; the fastest within 30%
    # of it, so the link is the 100 Mbit/s one and not the 20 or 1,000 of the full run. Not closer: the same probe
    # gives 92 to 96 on an idle machine here and under four busy torch processes, but the project's CI machine,
    # with the suite's other tests beside this one, measured 79.6 (one transfer) and 83 to 88 (three); what htb
    # delivers there is the host's, not this code's. The benchmark's report states the measured rate beside its
    # figures (bench/slowlink_report.py), and its own runs are made alone.
    assert len(rate["probe"]["tries_mbit"]) == 3, rate["probe"]
    assert all(t <= 100.0 for t in rate["probe"]["tries_mbit"]), rate["probe"]
    assert 70.0 <= rate["probe"]["mbit_per_s"] <= 100.0, rate["probe"]
    runs = rate["runs"]
    assert set(runs) == {"ddp", "asgd", "adacomp"}
    dense = MODEL_BYTES / BATCH  # one model per step of a worker, over its batch
    # DDP: a ring all-reduce sends and receives 2 (n-1)/n models per step; n = 2. Frames, the start-up's
    # broadcast of the model and Lightning's per-step flags add a few percent.
    ddp = runs["ddp"]
    for way in ("up_per_sample", "down_per_sample"):
        assert 0.98 <= ddp[way] / (2 * MODEL_BYTES * (2 - 1) / 2 / BATCH) <= 1.15, (way, ddp[way])
    # asgd: a dense push per step; the reply carries at most the whole model
    asgd = runs["asgd"]
    assert 0.98 <= asgd["up_per_sample"] / dense <= 1.15, asgd
    assert asgd["down_per_sample"] <= 1.15 * dense, asgd
    # the interfaces' count and the strategy's own agree within the frames' headers
    assert 1.0 <= asgd["up_per_sample"] / asgd["strategy_up_per_sample"] <= 1.05, asgd
    # adacomp pushes 1% of each layer (6 bytes a value): far under a tenth of asgd's pushes
    assert runs["adacomp"]["up_per_sample"] < 0.1 * asgd["up_per_sample"], runs["adacomp"]
    # beside rank 0's weights, our modes snapshot the central model it last received, at the same times
    for name in ("asgd", "adacomp"):
        central, curve = runs[name]["central_curve"], runs[name]["curve"]
        assert [t for t, _ in central] == [t for t, _ in curve][-len(central):] and len(central) >= 2, name
    assert runs["ddp"]["central_curve"] is None
    for name, r in runs.items():
        assert r["best_acc"] > 0.3, (name, r["curve"])  # chance is 0.1
        assert r["samples"] >= 32 * 10, (name, r["steps"])
