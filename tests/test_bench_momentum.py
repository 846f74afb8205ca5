"""bench.momentum's plan and table, on results made by hand (the launches themselves are bench.train's), its
--remedy pairs' settings and refusals, and its --stability quadratic."""

import pytest

from bench.momentum import ROWS, SIZES, markdown, plan, stable_bound, table


def test_the_plan_runs_ddp_then_every_row_on_and_off_per_optimizer_with_equal_samples():
    runs = plan(SIZES["full"], quick=False)
    assert len(runs) == 4 * (1 + 2 * len(ROWS))
    assert {r["train_subset"] for r in runs} == {8000} and {r["epochs"] for r in runs} == {1}
    off = [r for r in runs if r.get("compensation") is False]
    assert off and all(r["options"] == {"staleness_compensation": False} for r in off)
    only = plan(SIZES["full"], quick=False, only=["asgd+sign"])
    assert {r["row"] for r in only} == {"asgd+sign"} and len(only) == 4 * 2  # no DDP: its figures stand
    longer = plan({**SIZES["full"], "epochs": 4}, quick=False, only=["asgd+randomk"], ddp=True,
                  compensated_only=True)  # another size: DDP's figures do not stand
    assert [r["row"] for r in longer] == ["ddp", "asgd+randomk"] * 4 and {r["epochs"] for r in longer} == {4}
    stated = plan(SIZES["full"], quick=False, only=["asgd", "asgd+randomk", "adacomp"], compensated_only=True,
                  fraction=0.04)  # the fraction knob of the rows that have one, the others as they are
    assert {r["row"]: r["options"] for r in stated} == {"asgd": {}, "asgd+randomk": {"fraction": 0.04},
                                                         "adacomp": {"fraction": 0.04}}
    off = plan(SIZES["full"], quick=False, uncompensated_only=True)  # a fresh table of the off side: DDP beside
    assert len(off) == 4 * (1 + len(ROWS)) and {r.get("compensation") for r in off} == {None, False}
    with pytest.raises(ValueError, match="leave no run"):
        plan(SIZES["full"], quick=False, compensated_only=True, uncompensated_only=True)


def _run(row, acc, on=True, diverged=False, opt="sgd", lr=0.05):
    return {"row": row, "optimizer": opt, "lr": lr, "compensation": on, "test_acc": acc, "diverged": diverged}


def test_the_table_gives_each_cell_its_gap_to_ddp_and_judges_only_the_compensated_ones():
    results = [{"row": "ddp", "optimizer": "sgd", "lr": 0.05, "test_acc": 0.83},
               _run("asgd", 0.8254), _run("asgd", 0.70, on=False), _run("adacomp", 0.84),
               _run("adacomp", None, on=False, diverged=True)]
    t = table(results, workers=2)
    gaps = {(c["row"], c["compensation"]): c["gap_points"] for c in t["cells"]}
    assert gaps == {("asgd", True): -0.46, ("asgd", False): -13.0, ("adacomp", True): 1.0, ("adacomp", False): None}
    assert t["worst_gap_points"] == -0.46 and t["target_points"] == 1.0 and t["met"] is True
    assert "diverged" in markdown([t]) and "0.825 (-0.5) / 0.700 (-13.0)" in markdown([t])
    results.append(_run("hogwild", None, diverged=True))  # a compensated run that diverged misses any target
    assert table(results, workers=2)["met"] is False
    assert table(results[:3], workers=4)["met"] is True  # -0.46 is within 2 points at 4 workers


def test_with_seeds_the_gap_is_paired_by_seed_and_a_cell_diverged_in_one_seed_misses_the_target():
    runs = plan(SIZES["full"], quick=False, seeds=(0, 1), compensated_only=True)
    assert len(runs) == 2 * 4 * (1 + len(ROWS)) and all(r.get("compensation", True) for r in runs)
    assert {r["seed"] for r in runs} == {0, 1} and len({r["name"] for r in runs}) == len(runs)
    results = [{"row": "ddp", "optimizer": "sgd", "lr": 0.05, "test_acc": 0.80, "seed": 0},
               {"row": "ddp", "optimizer": "sgd", "lr": 0.05, "test_acc": 0.84, "seed": 1},
               {**_run("asgd", 0.79), "seed": 0}, {**_run("asgd", 0.845), "seed": 1}]
    t = table(results, workers=2)
    (cell,) = t["cells"]
    # paired: (0.79 - 0.80) and (0.845 - 0.84) -> -1.0 and +0.5, mean -0.25; unpaired means would give the same
    # mean here, but the range is the paired one
    assert cell["gap_points"] == -0.25 and cell["gap_range"] == [-1.0, 0.5]
    assert abs(t["ddp"]["sgd 0.05"] - 0.82) < 1e-12 and t["met"] is True and t["seeds"] == [0, 1]
    assert "0.818 (-0.2 [-1.0, +0.5]) / -" in markdown([t])
    results.append({**_run("adacomp", 0.84), "seed": 0})
    results.append({**_run("adacomp", None, diverged=True), "seed": 1})
    t = table(results, workers=2)
    assert t["met"] is False and t["worst_gap_points"] == -100.0
    # a row rerun with --rows is merged at the end of the results, but keeps its place in the table
    t = table([*results[:2], *results[4:], *results[2:4]], workers=2)  # DDP, adacomp, then asgd
    lines = [line.split(" |")[0] for line in markdown([t]).splitlines() if line.startswith("| a")]
    assert lines == ["| asgd", "| adacomp"]


def test_rows_rerun_merge_into_a_table_assembled_from_several_commands(tmp_path, monkeypatch):
    import json

    import bench.momentum as bm

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train-images-idx3-ubyte.gz").write_bytes(b"")
    monkeypatch.setattr(bm, "FASHION", tmp_path / "data")
    monkeypatch.setattr(bm, "machine", lambda: {"commit": "abc1234"})  # (it asks git, a process)
    ddp = {"name": "ddp sgd 0.05", "row": "ddp", "optimizer": "sgd", "lr": 0.05, "test_acc": 0.83, "seed": 0}
    old = {**_run("downpour", 0.80), "name": "downpour sgd 0.05 on", "seed": 0}
    kept = {**_run("asgd", 0.82), "name": "asgd sgd 0.05 on", "seed": 0}
    # a table put together from several commands (a lent machine's launches, once), no single "command"
    (tmp_path / "m.json").write_text(json.dumps({"machine": {"cpu_count": 16}, "commands": ["a", "b"],
                                                 "runs": {"2": [ddp, old, kept]}}))
    launched = []

    def fake(workers, every, size, out, parallel, threads):
        launched.extend(every)
        return [{**r, "test_acc": 0.815} for r in every]

    monkeypatch.setattr(bm, "_launches", fake)
    assert bm.main(["--workers", "2", "--rows", "downpour", "--optimizers", "sgd", "--compensated-only",
                    "--out", str(tmp_path), "--name", "m"]) == 0
    assert {(r["row"], r["lr"]) for r in launched} == {("downpour", 0.01), ("downpour", 0.05)}  # no DDP rerun
    merged = json.loads((tmp_path / "m.json").read_text())
    accs = {r["name"]: r["test_acc"] for r in merged["runs"]["2"]}
    assert accs["downpour sgd 0.05 on"] == 0.815 and accs["asgd sgd 0.05 on"] == 0.82 and accs["ddp sgd 0.05"] == 0.83
    assert merged["earlier"] == [{"commands": ["a", "b"], "machine": {"cpu_count": 16}}]
    cell = next(c for c in merged["tables"][0]["cells"] if c["row"] == "downpour" and c["lr"] == 0.05)
    assert cell["gap_points"] == -1.5  # 0.815 against DDP's 0.83 of the same seed

    # the side a compensated-only table lacks, merged beside it: every row off, nothing on rerun, DDP's stands
    launched.clear()
    assert bm.main(["--workers", "2", "--optimizers", "sgd", "--uncompensated-only", "--out", str(tmp_path),
                    "--name", "m"]) == 0
    assert {r["compensation"] for r in launched} == {False} and {r["row"] for r in launched} == {n for n, _ in ROWS}
    merged = json.loads((tmp_path / "m.json").read_text())
    cells = {(c["row"], c["lr"], c["compensation"]): c["gap_points"] for c in merged["tables"][0]["cells"]}
    assert cells[("downpour", 0.05, True)] == -1.5 and cells[("downpour", 0.05, False)] == -1.5
    assert cells[("asgd", 0.05, True)] == -1.0
    assert "0.815 (-1.5) / 0.815 (-1.5)" in (tmp_path / "m.md").read_text()
    t = table([*[{"row": "ddp", "optimizer": "sgd", "lr": 0.05, "test_acc": 0.83, "seed": s} for s in (0, 1)],
               *[{**_run("asgd", 0.82), "seed": s} for s in (0, 1)], {**_run("asgd", 0.80, on=False), "seed": 0}],
              workers=2)
    assert "means over seeds 0, 1 (the gap paired by seed, [min, max]); compensation off: seed 0" in markdown([t])


def test_the_remedy_benchmark_leaves_out_its_remedy_alone_and_the_strategy_takes_what_it_gives():
    """bench.momentum --remedy's "off" runs: each row's own default compensation with the one remedy off, nothing
    else changed (hogwild keeps its scaled step only, agn its unscaled fold), which the strategy accepts."""
    from bench.momentum import without
    from plug_asgd import AsyncPSStrategy, StalenessCompensation

    settings = dict(ROWS)
    for row, remedy in (("hogwild", "nesterov"), ("downpour", "nesterov"), ("agn", "nesterov"),
                        ("asgd+randomk", "nesterov"), ("downpour", "scale"), ("asgd+topk", "mask_momentum")):
        off = without(settings[row], remedy)
        default = AsyncPSStrategy(mode=settings[row]["mode"]).staleness_compensation
        assert getattr(default, remedy) and off == {**default.__dict__, remedy: False}, (row, remedy)
        taken = AsyncPSStrategy(mode=settings[row]["mode"], staleness_compensation=off).staleness_compensation
        assert taken == StalenessCompensation(**off), row


def test_the_remedy_benchmark_refuses_rows_it_does_not_know_and_a_lone_worker(tmp_path, capsys):
    from bench.momentum import main

    for argv, says in ((["--rows", "nonesuch"], "unknown row(s) ['nonesuch']"), (["--workers", "1"], "--workers 1"),
                       (["--workers", "2", "4"], "--workers 2 4: one count"),
                       (["--remedy", "window"], "invalid choice: 'window'"),
                       (["--remedy", "scale", "--rows", "asgd", "agn"], "rows ['agn'] do not take scale by default")):
        remedy = [] if "--remedy" in argv else ["--remedy", "nesterov"]
        with pytest.raises(SystemExit) as refused:
            main([*remedy, *argv, "--out", str(tmp_path / "work")])
        assert refused.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # nothing launched


def test_the_stability_quadratic_gives_the_bounds_docs_momentum_quotes(capsys):
    """bench.momentum --stability: one process's bound is the heavy ball's 2 (1 + mu), Nesterov's 1.357, and the
    look-ahead with the scale the widest of the remedies at 2 workers (docs/momentum.md's table: 1.254)."""
    from bench.momentum import main

    assert stable_bound(workers=1) == pytest.approx(3.8, abs=1e-3)
    assert stable_bound(workers=1, nesterov=True) == pytest.approx(1.357, abs=1e-3)
    assert stable_bound(workers=2, lookahead=True, scale=0.5) == pytest.approx(1.254, abs=1e-3)
    assert stable_bound(workers=2) == pytest.approx(0.190, abs=1e-3)
    assert main(["--stability"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "one process: 3.800 (heavy ball), 1.357 (Nesterov)"
    assert lines[2].split() == ["2", "1", "0.190", "0.379", "0.359", "0.627", "0.662", "1.254", "1.119"]
