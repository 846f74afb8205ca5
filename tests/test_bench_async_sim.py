"""``python -m bench async_sim``: async_diloco's outer update simulated in one process (bench/diloco_async_sim.py)."""

from __future__ import annotations

import json

import pytest

from bench.diloco_async_sim import main, markdown, simulate, summarize
from plug_asgd.recipes.lm_data import FORTUNE_FILES, FORTUNES_DIR
from tests.conftest import skip_unless_required

HAVE_FORTUNES = all((FORTUNES_DIR / name).is_file() for name in FORTUNE_FILES)


def _run(config: str, seed: int, curve: list[tuple[float, float]]) -> dict:
    return {"config": config, "seed": seed, "curve": curve}


def test_the_table_reads_each_run_against_the_synchronous_run_of_its_seed():
    runs = [_run("diloco", 0, [(0, 5.0), (200, 3.0), (400, 2.5)]),
            _run("diloco", 1, [(0, 5.0), (200, 3.2), (400, 2.8)]),
            # seed 0 reaches 2.5 at t = 300 (0.75 of diloco's 400) after a rise of 0.4; seed 1 never reaches 2.8
            _run("async_diloco", 0, [(0, 5.0), (100, 3.0), (150, 3.4), (200, 2.9), (300, 2.5)]),
            _run("async_diloco", 1, [(0, 5.0), (100, 3.5), (200, 3.1), (300, 2.9)])]
    rows = {r["config"]: r for r in summarize(runs)}
    assert set(rows) == {"diloco", "async_diloco"}  # the configurations without runs are left out
    mine = rows["async_diloco"]
    assert mine["final_loss"] == [2.5, 2.9] and mine["final_loss_median"] == pytest.approx(2.7)
    assert mine["time_to_diloco_final"] == [0.75, None]
    assert mine["swing"] == pytest.approx([0.4, -0.2])  # from the first evaluation after the start
    assert rows["diloco"]["time_to_diloco_final"] == [1.0, 1.0]
    text = markdown(list(rows.values()), "python -m bench async_sim", {"inner_steps": 100, "steps": 600,
                                                                          "slow_factor": 2.0})
    assert "| async_diloco | nesterov lr 0.7 momentum 0.9 | 2.500, 2.900 | 0.75, never | +0.400, -0.200 |" in text


@pytest.mark.integration  # bench.common.machine asks git for the commit
def test_quick_refuses_an_unknown_configuration_and_folds_each_arrival_on_its_schedule(tmp_path, capsys):
    if not HAVE_FORTUNES:
        skip_unless_required("the corpus is not installed: apt-get install fortunes (scripts/setup.sh)")
    with pytest.raises(SystemExit) as refused:
        main(["--quick", "--configs", "diloco,async_sim_typo"])
    assert refused.value.code == 2 and "configurations are among" in capsys.readouterr().err
    assert main(["--quick", "--configs", "diloco,async_diloco", "--jobs", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "async_sim.json").read_text())
    assert [r["config"] for r in report["rows"]] == ["diloco", "async_diloco"]
    runs = {r["config"]: r["curve"] for r in report["runs"]}
    # the synchronous reference: 20 steps in rounds of H = 5, each lasting the slow worker's 2 x 5
    assert [t for t, _ in runs["diloco"]] == [0, 10, 20, 30, 40]
    # asynchronous: worker 0 arrives every 5 (H), worker 1 every 2 x 2 (round(5 / 2) steps at half speed), until
    # both made 20 steps (worker 1's 10th arrival at 40); the earlier worker first at a tie
    times = sorted({5 * k for k in range(1, 9)} | {4 * k for k in range(1, 11)})
    expected = [0] + [t for t in times for _ in range(2 if t % 20 == 0 else 1)]
    assert [t for t, _ in runs["async_diloco"]] == expected
    assert (tmp_path / "async_sim.md").read_text().count("\n| ") == 2 + 1  # the header and a row each


def test_one_simulation_is_the_same_bits_twice():
    if not HAVE_FORTUNES:
        skip_unless_required("the corpus is not installed: apt-get install fortunes (scripts/setup.sh)")
    size = {"inner_steps": 2, "steps": 4, "slow_factor": 2.0, "val_windows": 16}
    assert simulate("async_diloco", 0, size) == simulate("async_diloco", 0, size)
