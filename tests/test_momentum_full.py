"""Momentum SGD on Fashion-MNIST at issue 17's own bound: every mode within 1.5 points of DDP. The full tier.

``tests/test_momentum.py`` fits the momentum SGD rows of the modes in the suite (not the codecs', which it pushes
on short runs for their bytes), once each at 8,000 images, and holds them to 5 points: at that size one run's
accuracy varies by up to 6.5 points from one launch to the next (its comments say where), so a 1.5-point bound
there would test the noise. Here every mode (the synchronous ones too) and every codec trains on 16,000 images with
seeds 0, 1 and 2 (initialization and training subset), DDP with each seed, all tested on the whole test set; a
row's gap is its accuracy minus DDP's of the same seed, and the median of its three gaps must be at least -1.5
points. 69 runs, 34 minutes on 2 cores: far beyond the suite's budget, so these tests run only when selected
(``pytest -m full``; ``tests/conftest.py`` skips them otherwise). Their last run: bench/results/momentum_full.json.
"""

from __future__ import annotations

import statistics

import pytest

from tests.conftest import HAVE_FASHION, needs_fashion
from tests.test_momentum import CODECS, NESTEROV_ROWS, STEP_MODES

pytestmark = [pytest.mark.integration, pytest.mark.full]

POINTS = 1.5  # issue 17's bound
SEEDS = (0, 1, 2)
TRAIN_SUBSET = 16_000
# every mode but eamsgd (Nesterov's own: in the Nesterov rows), and asgd under every codec with error feedback
SGD_ROWS = [(m, {"mode": m}) for m in STEP_MODES if m != "eamsgd"] + [  # (DiLoCo: test_momentum.py says why)
    (c, {"mode": "asgd", "compressor": c.partition("+")[2]}) for c in CODECS]
# a seed's launch: 23 runs of about 30 s on 2 idle cores (16,000 images, then 10,000 test images; 11 min)
LAUNCH_TIMEOUT_S = 1800
# Measured to miss the bound, and why. sagn divides each worker's update of its 4 local steps by 4 and the round
# averages them: the central model moves one local step's worth per round, DDP with accumulate_grad_batches=4
# at the same learning rate, a quarter of DDP's steps per sample. Synchronous, so no race moves it (on the
# regression case its fits repeat to the last digit): -1.64, -2.59, -1.94 on seeds 0, 1, 2
# (bench/results/momentum_full.json).
# Strict: should it pass, the test says so.
MISSES = {("sgd", "sagn"): "sagn's normalized rounds move a quarter of DDP's steps per sample at 2 workers"}


def seed_runs(seed: int) -> list[dict]:
    """DDP and every row of each optimizer, with ``seed``: SGD(lr=0.05, momentum=0.9), plain and Nesterov's."""
    common = {"bench": "momentum_full", "batch_size": 32, "train_subset": TRAIN_SUBSET, "epochs": 1, "test": True,
              "lr": 0.05, "momentum": 0.9, "seed": seed}
    runs = []
    for optimizer, table in (("sgd", SGD_ROWS), ("nesterov", NESTEROV_ROWS)):
        runs.append({**common, "optimizer": optimizer, "kind": "ddp", "name": f"ddp {optimizer} {seed}"})
        runs += [{**common, **settings, "optimizer": optimizer, "kind": "asgd", "name": f"{row} {optimizer} {seed}"}
                 for row, settings in table]
    return runs


@pytest.fixture(scope="module")
def accuracies(tmp_path_factory) -> dict[str, float]:
    """Test accuracy by run name ("row optimizer seed"), one launch of 2 workers per seed."""
    from bench.runner import launch

    if not HAVE_FASHION:
        pytest.skip("Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
    found: dict[str, float] = {}
    for seed in SEEDS:
        results = launch(2, seed_runs(seed), {"test_subset": None, "timeout": LAUNCH_TIMEOUT_S},
                         tmp_path_factory.mktemp(f"seed{seed}"))
        errors = [r["launch_error"] for r in results if "launch_error" in r]
        assert not errors, errors
        found.update({r["name"]: r["test_acc"] for r in results})
    return found


@needs_fashion
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 300)  # the fixture's three launches, charged to the first test
@pytest.mark.parametrize("optimizer,row", [
    pytest.param(o, r, marks=[pytest.mark.xfail(strict=True, reason=MISSES[o, r])] if (o, r) in MISSES else [])
    for o, rows in (("sgd", SGD_ROWS), ("nesterov", NESTEROV_ROWS)) for r, _ in rows])
def test_every_mode_trains_momentum_sgd_within_issue_17s_bound_of_ddp(accuracies, optimizer, row):
    gaps = [100 * (accuracies[f"{row} {optimizer} {s}"] - accuracies[f"ddp {optimizer} {s}"]) for s in SEEDS]
    assert statistics.median(gaps) >= -POINTS, (
        f"{row} {optimizer}: gaps to DDP by seed {[round(g, 2) for g in gaps]} "
        f"(DDP {[round(accuracies[f'ddp {optimizer} {s}'], 4) for s in SEEDS]})")
