"""Lightning's Trainer features under every mode, 2 workers: what each feature promises, not just that fit returned.

One launch of tests/scripts/feature_fit.py for every mode (real processes, Lightning's launcher, an
embedded PS per fit); each test reads what both ranks wrote for its mode. The expected values are counted here from
the script's settings: 512 training samples, 2 ranks, batch 16, so 16 batches per rank and epoch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness.ports import free_port_block
from plug_asgd.modes import MODES
from tests.conftest import PYTHON, full_tier_param, params_to_run, run_to_end
from tests.scripts.feature_fit import MAX_TIME

pytestmark = pytest.mark.integration
BATCHES = 512 // 2 // 16  # per rank and epoch
# modes whose workers never wait for each other at a step (ssp waits past its bound; the sync family every round)
NO_LOCKSTEP = {"asgd", "adacomp", "downpour", "dynsgd", "agn", "hogwild", "easgd", "eamsgd"}
LAUNCH_S = 400  # every mode in one launch: 2 processes that start once (measured: about 150 s on 2 cores)
# The suite's modes: one for each path a worker takes through Lightning's hooks (the features are the worker's, the
# PS's rules do not see them): asgd (a push each step, compensated), sync (rounds in lockstep), localsgd (local steps
# between rounds), osp (rounds overlapped with the steps), hogwild (one shared tensor), easgd (elastic), diloco (inner
# steps, an outer step), async_diloco (inner steps shortened to the others' pace). The full tier fits the others.
SUITE_MODES = ("asgd", "sync", "localsgd", "osp", "hogwild", "easgd", "diloco", "async_diloco")


@pytest.fixture(scope="module")
def launch(request, tmp_path_factory):
    """One launch of 2 processes fitting each mode this session's tests check, one after the other."""
    modes = params_to_run(request, "run")
    out = tmp_path_factory.mktemp("features")
    ports = free_port_block(5 * len(modes))
    run_to_end([PYTHON, "tests/scripts/feature_fit.py", ",".join(modes), str(out), str(ports)], timeout=LAUNCH_S)
    return out


@pytest.fixture(scope="module", params=[full_tier_param(m, SUITE_MODES) for m in MODES])
def run(request, launch):
    out = launch / request.param
    return request.param, out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(LAUNCH_S + 30)  # the module fixture's launch, when this is the first test
def test_early_stopping_validation_mid_epoch_accumulation_and_schedulers(run):
    mode, _, ranks = run
    for seen in ranks:
        fit = seen["fit"]
        # validation every half epoch (8 batches); EarlyStopping(patience=2) stops at the 3rd: batch 24, in epoch 1
        assert fit["batches"] == 3 * BATCHES // 2 and fit["stopped_epoch"] == 1, (mode, fit)
        assert fit["global_step"] == fit["batches"] // 2  # accumulate_grad_batches=2
        # StepLR(4, 0.9) stepped at each of the 12 optimizer steps; ReduceLROnPlateau(0.5) at most at epoch 1's end
        assert any(math.isclose(fit["lr"], 0.05 * 0.9 ** 3 * 0.5 ** k, rel_tol=1e-9) for k in (0, 1)), fit["lr"]
        assert 0 < fit["max_grad"] <= 0.5 + 1e-5  # gradient_clip_val=0.5, by norm
    assert ranks[0]["fit"]["weights"] == ranks[1]["fit"]["weights"]  # both end on the central model


@pytest.mark.timeout(LAUNCH_S + 30)
def test_the_best_checkpoint_holds_the_central_model_it_was_scored_on(run):
    from tests.scripts.feature_fit import Blobs, Net

    mode, _, ranks = run
    fit = ranks[0]["fit"]
    best = Net.load_from_checkpoint(fit["best"], map_location="cpu")
    x, y = Blobs().val_dataloader().dataset.tensors
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(best(x), y).item()
    # ModelCheckpoint's score: the val_loss both ranks reduced (bf16 autocast); here the same data in float32
    assert math.isclose(loss, fit["best_score"], rel_tol=0.03, abs_tol=0.01), (mode, loss, fit["best_score"])
    last = torch.load(fit["last"], map_location="cpu", weights_only=False)
    assert last["global_step"] == fit["global_step"]


@pytest.mark.timeout(LAUNCH_S + 30)
def test_a_fit_resumed_from_its_checkpoint_continues_with_the_central_model_and_the_optimizer(run):
    mode, _, ranks = run
    saved = torch.load(ranks[0]["fit"]["last"], map_location="cpu", weights_only=False)
    for seen in ranks:
        started = seen["resume"]["started"]
        assert started["global_step"] == seen["fit"]["global_step"], (mode, started)
        assert started["momentum_buffers"] == 4  # SGD's state for the 4 tensors came back
        expected = [t.float().flatten().tolist() for t in saved["state_dict"].values()]
        assert started["weights"] == expected, mode
        # from the middle of epoch 1, to max_epochs = 3, without accumulation: 8 + 16 steps more
        assert seen["resume"]["global_step"] == seen["fit"]["global_step"] + BATCHES // 2 + BATCHES, mode


@pytest.mark.timeout(LAUNCH_S + 30)
def test_validate_test_predict_and_the_loggers(run):
    mode, out, ranks = run
    for seen in ranks:
        assert seen["validate"]["val_loss"] < 0.69  # below chance: the trained central model was evaluated
        assert seen["test"]["test_acc"] >= 0.85, (mode, seen["test"])
        assert seen["predict"] == 128 // 2  # each rank predicts its half
    assert ranks[0]["validate"] == ranks[1]["validate"] and ranks[0]["test"] == ranks[1]["test"]
    rows = (Path(ranks[0]["fit"]["csv"]) / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",").count("val_loss") == 1 and len(rows) > 3
    assert list(Path(ranks[0]["fit"]["tb"]).glob("events.out.tfevents.*"))


@pytest.mark.timeout(LAUNCH_S + 30)
def test_max_steps_and_max_time_stop_every_worker(run):
    mode, _, ranks = run
    assert [seen["max_steps"] for seen in ranks] == [7, 7]
    timed = [seen["max_time"] for seen in ranks]
    assert all(MAX_TIME <= t["seconds"] <= MAX_TIME + 10 for t in timed), (mode, timed)
    if mode in NO_LOCKSTEP:  # rank 1 sleeps 30 ms a step: apart, rank 0 makes several times its steps
        assert timed[0]["global_step"] >= 2 * timed[1]["global_step"] > 0, (mode, timed)


@pytest.mark.timeout(LAUNCH_S + 30)
def test_manual_optimization_with_two_optimizers(run):
    mode, _, ranks = run
    for seen in ranks:
        assert seen["manual"]["global_step"] == 2 * BATCHES  # each optimizer's step counts
        assert all(math.isfinite(v) for w in seen["manual"]["weights"] for v in w)
    assert ranks[0]["manual"]["weights"] == ranks[1]["manual"]["weights"], mode


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["command line", "yaml"])
def test_lightning_cli_chooses_the_strategy(tmp_path, how):
    port = free_port_block(1)
    trainer = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_epochs=1", "--trainer.logger=false",
               "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
               f"--trainer.default_root_dir={tmp_path}"]  # where the CLI saves the config it ran
    if how == "command line":
        args = ["--trainer.strategy=async_ps_adacomp", *trainer]
        expected = {"name": "adacomp"}
    else:
        config = tmp_path / "run.yaml"  # not config.yaml: the CLI saves the config it ran there
        # the class of the namespace the program imports: plug_asgd.AsyncPSStrategy is not a subclass of either
        config.write_text("trainer:\n  strategy:\n    class_path: plug_asgd.pytorch_lightning.AsyncPSStrategy\n"
                          f"    init_args:\n      mode: {{name: downpour, push_every: 2}}\n      ps_port: {port}\n")
        args = [f"--config={config}", *trainer]
        expected = {"name": "downpour", "push_every": 2}
    run_to_end([PYTHON, "tests/scripts/cli_fit.py", "fit", *args], timeout=150, env={"FEATURE_OUT": str(tmp_path)})
    for r in (0, 1):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["strategy"] == "AsyncPSStrategy" and seen["world_size"] == 2
        assert expected.items() <= seen["mode"].items(), seen["mode"]
        assert seen["global_step"] == BATCHES
