"""bench.learning's plan, DiLoCo's inner_steps and the table's arithmetic, on results made by hand (the launches
themselves are bench.train's); and, selected with ``-m full``, ``--quick`` end to end."""

import json
import sys

import pytest

import bench.learning as learning
from bench.learning import DILOCO, MIN_ROUNDS, all_rows, inner_steps, markdown_rows, plan, table
from plug_asgd.modes import MODES


def test_the_plan_runs_ddp_then_every_mode_per_model_and_seed_with_the_same_settings():
    runs = plan(["cnn", "lm"], [0, 1, 2], all_rows())
    # every mode, and async_diloco at the outer step docs/modes.md gives for 2 workers right after it
    rows = [*MODES][:-1]
    rows.insert(rows.index("async_diloco") + 1, "async_diloco-sgd")
    assert all_rows() == [*rows, "eamsgd"] and len(runs) == 2 * 3 * (3 + len(MODES))
    for model in ("cnn", "lm"):
        for seed in (0, 1, 2):
            mine = [r for r in runs if r["model"] == model and r["seed"] == seed]
            # DDP per seed, then every row, eamsgd last beside DDP of its optimizer
            assert [r["row"] for r in mine] == ["ddp", *rows, "ddp+nesterov", "eamsgd"]
            assert [r["kind"] for r in mine] == ["ddp", *["asgd"] * len(rows), "ddp", "asgd"]
            assert all(r["mode"] == r["row"] for r in mine if r["kind"] == "asgd" and r["row"] in MODES)
            variant = next(r for r in mine if r["row"] == "async_diloco-sgd")
            assert variant["mode"] == "async_diloco"
            assert variant["options"]["outer"] == {"name": "sgd", "lr": 1.0, "momentum": 0.0}
            assert variant["note"].startswith("outer SGD lr 1.0, no momentum; inner_steps ")
            shared = ("optimizer", "lr", "momentum", "batch_size", "train_subset", "test_subset", "epochs", "lm")
            # the same optimizer and data for every row, and for eamsgd and its own DDP
            assert len({json.dumps([r.get(k) for k in shared]) for r in mine[:-2]}) == 1
            assert len({json.dumps([r.get(k) for k in shared]) for r in mine[-2:]}) == 1
            assert mine[-1]["reference"] == "ddp+nesterov" and mine[-1]["optimizer"] == "nesterov"
            assert [r[k] for r in mine[-2:] for k in shared[3:6]] == [r[k] for r in mine[:2] for k in shared[3:6]]
    cnn = [r for r in runs if r["model"] == "cnn" and r["optimizer"] != "nesterov"]
    assert {(r["optimizer"], r["lr"], r["momentum"], r["batch_size"], r["train_subset"]) for r in cnn} == {
        ("sgd", 0.05, 0.9, 32, 8000)} and {r["test_subset"] for r in cnn} == {None}
    lm = [r for r in runs if r["model"] == "lm"]
    size = {"d_model": 64, "layers": 2, "heads": 4, "max_context": 32, "warmup_steps": 20}
    assert {json.dumps(r["lm"], sort_keys=True) for r in lm} == {
        json.dumps({**size, "optimizer": "adam", "lr": 1e-3}, sort_keys=True),
        json.dumps({**size, "optimizer": "nesterov", "lr": 0.05, "momentum": 0.9}, sort_keys=True)}
    assert {r["lm"]["optimizer"] for r in lm if r["row"] in ("ddp+nesterov", "eamsgd")} == {"nesterov"}
    assert learning.steps_per_worker("lm", "full") == 400 and learning.steps_per_worker("cnn", "full") == 125
    assert len({r["name"] for r in runs}) == len(runs)
    with pytest.raises(ValueError, match="unknown"):
        plan(["cnn"], [0], ["asgd", "nope"])
    # the delayed Nesterov at momentum 0.5 (as measured: without the lookahead), and the default without the
    # lookahead: asked for by --rows only, after the outer SGD's row
    assert "async_diloco-m05" not in all_rows() and "async_diloco-nolookahead" not in all_rows()
    opt_in = all_rows(opt_in=True)
    assert opt_in.index("async_diloco-m05") == opt_in.index("async_diloco-sgd") + 1
    assert opt_in.index("async_diloco-nolookahead") == opt_in.index("async_diloco-m05") + 1
    m05 = plan(["lm"], [0], ["async_diloco-m05"])[-1]
    assert (m05["mode"], m05["options"]["outer"]) == ("async_diloco", {"name": "nesterov", "lr": 0.7, "momentum": 0.5})
    assert m05["options"]["momentum_lookahead"] is False
    plain = plan(["lm"], [0], ["async_diloco-nolookahead"])[-1]
    assert (plain["mode"], plain["options"]) == ("async_diloco", {"momentum_lookahead": False})
    assert "options" not in plan(["lm"], [0], ["async_diloco"])[-1]  # the default: with the lookahead
    # diloco's outer step at other settings: by --rows only, each row's outer optimizer as its name says
    outers = {row: plan(["lm"], [0], [row])[-1]["options"]["outer"] for row in opt_in if row.startswith("diloco-")}
    assert not set(outers) & set(all_rows())
    assert {row: (o["name"], o["lr"], o["momentum"]) for row, o in outers.items()} == {
        "diloco-sgd": ("sgd", 1.0, 0.0), "diloco-sgd15": ("sgd", 1.5, 0.0), "diloco-sgd2": ("sgd", 2.0, 0.0),
        "diloco-lr1": ("nesterov", 1.0, 0.9), "diloco-m03": ("nesterov", 0.7, 0.3),
        "diloco-m05": ("nesterov", 0.7, 0.5), "diloco-m07": ("nesterov", 0.7, 0.7),
        "diloco-lr1-m05": ("nesterov", 1.0, 0.5)}


def test_diloco_keeps_its_default_inner_steps_where_it_makes_enough_rounds_and_says_so_where_not():
    h = learning.default_inner_steps()
    assert h == MODES["diloco"]().inner_steps == 100
    assert inner_steps(400, h) == 100  # the LM: 4 rounds at the default
    assert inner_steps(125, h) == 25  # the CNN: 1 round at the default; 25 divides 125, 5 rounds
    assert inner_steps(40, h) == 10 and inner_steps(97, h) == 24  # no good divisor of a prime: steps // 4
    with pytest.raises(ValueError):
        inner_steps(3, h)
    runs = {(r["model"], r["row"]): r for r in plan(["cnn", "lm"], [0], list(DILOCO))}
    assert "options" not in runs["lm", "diloco"] and runs["lm", "diloco"]["note"] == "inner_steps 100 (4 rounds)"
    for row in DILOCO:
        cnn = runs["cnn", row]
        assert cnn["options"] == {"inner_steps": 25} and "not the default 100" in cnn["note"]
        assert 125 // cnn["options"]["inner_steps"] >= MIN_ROUNDS
    forced = plan(["lm"], [0], ["diloco"], forced_inner_steps=50)[1]
    assert forced["options"] == {"inner_steps": 50} and "8 rounds" in forced["note"]


def _r(row, seed, loss, acc, **kw):
    return {"model": "cnn", "row": row, "seed": seed, "test_loss": loss, "test_acc": acc, **kw}


def test_the_table_pairs_each_seed_with_ddp_of_that_seed():
    results = [_r("ddp", 0, 0.50, 0.80), _r("ddp", 1, 0.40, 0.84), _r("ddp", 2, 0.60, 0.82),
               _r("asgd", 0, 0.55, 0.79), _r("asgd", 1, 0.40, 0.845), _r("asgd", 2, 0.90, 0.70),
               {**_r("asgd", 0, 9.0, 0.1), "model": "lm"}]  # another model's: not in this table
    ddp, asgd = table(results, "cnn")
    assert ddp["row"] == "ddp" and ddp["loss"] == {"mean": 0.5, "min": 0.4, "max": 0.6}
    assert ddp["reference"] is None and ddp["acc_points"]["mean"] is None  # the reference itself
    # accuracy: -1.0, +0.5, -12.0 points -> mean -4.17; loss: 1.1, 1.0, 1.5 -> mean 1.2
    assert asgd["acc_points"] == {"mean": -4.17, "min": -12.0, "max": 0.5}
    assert asgd["loss_ratio"] == {"mean": 1.2, "min": 1.0, "max": 1.5}
    assert asgd["acc"] == {"mean": 0.7783, "min": 0.7, "max": 0.845} and asgd["loss"]["mean"] == 0.6167
    assert asgd["finished"] == [0, 1, 2] and asgd["lost"] == {}
    line = markdown_rows([ddp, asgd])[-1]
    assert line.startswith("| asgd | 0.6167 (0.4000..0.9000) | 1.200 (1.000..1.500) | 0.7783 (0.7000..0.8450) | "
                           "-4.17 (-12.00..+0.50) | 3/3 |")


def test_eamsgd_is_paired_with_ddp_of_its_own_optimizer():
    results = [_r("ddp", 0, 0.5, 0.80), _r("ddp+nesterov", 0, 0.4, 0.82), {**_r("eamsgd", 0, 0.6, 0.79),
                                                                            "reference": "ddp+nesterov"}]
    rows = {r["row"]: r for r in table(results, "cnn")}
    assert list(rows) == ["ddp", "ddp+nesterov", "eamsgd"]
    assert rows["eamsgd"]["acc_points"]["mean"] == -3.0 and rows["eamsgd"]["loss_ratio"]["mean"] == 1.5
    assert rows["ddp+nesterov"]["acc_points"]["mean"] == 2.0 and rows["ddp+nesterov"]["reference"] == "ddp"


def test_a_diverged_or_failed_seed_is_left_out_of_the_means_and_named():
    nan = float("nan")
    results = [_r("ddp", 0, 0.5, 0.8), _r("ddp", 1, 0.4, 0.9),
               _r("sync", 0, 0.6, 0.7), _r("sync", 1, None, None, diverged=True),
               _r("hogwild", 0, nan, 0.1), _r("hogwild", 1, None, None, failed=True),
               _r("downpour", 0, None, None, diverged=True), _r("downpour", 1, None, None, diverged=True)]
    rows = {r["row"]: r for r in table(results, "cnn")}
    assert rows["sync"]["finished"] == [0] and rows["sync"]["lost"] == {"1": "diverged"}
    assert rows["sync"]["acc_points"] == {"mean": -10.0, "min": -10.0, "max": -10.0}
    assert rows["sync"]["loss_ratio"]["mean"] == 1.2
    assert rows["hogwild"]["lost"] == {"0": "diverged", "1": "failed"}  # a NaN loss is a divergence
    text = "\n".join(markdown_rows(list(rows.values())))
    assert "| sync | 0.6000 | 1.200 | 0.7000 | -10.00 | 1/2 | seed 1 diverged |" in text
    assert "| hogwild | - | - | - | - | 0/2 | all failed or diverged (seed 0 diverged, seed 1 failed) |" in text
    assert "| downpour | - | - | - | - | 0/2 | all diverged (seed 0 diverged, seed 1 diverged) |" in text
    # without DDP of a seed there is no gap for that seed, but the row's own values stand
    alone = {r["row"]: r for r in table([_r("ddp", 0, 0.5, 0.8), _r("asgd", 0, 0.5, 0.8), _r("asgd", 1, 0.7, 0.6),
                                         _r("ddp", 1, None, None, failed=True)], "cnn")}
    assert alone["asgd"]["acc_points"]["mean"] == 0.0 and alone["asgd"]["acc"]["mean"] == 0.7


def test_a_run_that_stops_its_launch_is_recorded_as_failed_and_the_runs_after_it_go_on(monkeypatch, tmp_path):
    runs = plan(["cnn"], [0], ["asgd", "sync", "diloco"])
    calls = []

    def fake(workers, left, work, name, *, test_subset, timeout, stall_s):  # the launch crashes at "sync" first
        assert (workers, test_subset, timeout, stall_s) == (2, None, None, learning.STALL_S["quick"])
        calls.append([r["row"] for r in left])
        done = [{**r, "test_loss": 0.5, "test_acc": 0.8, "ranks": []} for r in left if r["row"] != "sync"]
        return (done[:2], "exit 1") if len(calls) == 1 else (done, None)

    monkeypatch.setattr(learning, "train", fake)
    results, errors = learning.run_launch("cnn", 0, runs, "quick", tmp_path)
    assert calls == [["ddp", "asgd", "sync", "diloco"], ["diloco"]]
    assert [(r["row"], r.get("failed", False)) for r in results] == [
        ("ddp", False), ("asgd", False), ("sync", True), ("diloco", False)]
    assert errors == ["cnn sync seed 0: exit 1"] and "ranks" not in results[0]
    assert {r["row"]: r["lost"] for r in table(results, "cnn")}["sync"] == {"0": "failed"}


@pytest.mark.full
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_quick_runs_every_quick_row_on_both_models_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench"])
    code = learning.main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "learning.json").read_text())
    assert code == 0, report["errors"]
    for model in ("cnn", "lm"):
        rows = {r["row"]: r for r in report["tables"][model]}
        assert set(rows) == {"ddp", "asgd", "sync", "diloco"}
        assert all(r["finished"] == [0] for r in rows.values()), rows
    assert "| diloco |" in (tmp_path / "learning.md").read_text()
