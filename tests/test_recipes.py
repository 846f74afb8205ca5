"""The recipes' device flags: ``--workers``, ``--devices`` and ``--accelerator``, and the Trainer they make.

In process and quick, except one run of ``recipes/mnist.py --accelerator gpu`` on a machine without a GPU (it
must end with one line of error, not a traceback). torch's view of CUDA is monkeypatched where a GPU is needed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from plug_asgd.recipes import common, mnist
from plug_asgd.strategy import AsyncPSStrategy
from tests.conftest import child_env

REPO = Path(__file__).resolve().parent.parent


def devices_of(*argv: str) -> dict[str, Any]:
    return common.trainer_devices(mnist.build_parser().parse_args(list(argv)))


def gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """torch, as it would be on a machine with ``count`` CUDA GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_workers_are_cpu_processes_by_default():
    assert devices_of() == {"accelerator": "cpu", "devices": 2, "num_nodes": 1}
    # the README's command, as it always ran: three CPU processes
    assert devices_of("--workers", "3", "--mode", "asgd", "--data-dir", "/data") == {
        "accelerator": "cpu", "devices": 3, "num_nodes": 1}
    assert devices_of("--workers", "4", "--num-nodes", "2")["devices"] == 4


def test_devices_is_workers_under_lightnings_name():
    assert devices_of("--devices", "3")["devices"] == 3
    assert devices_of("--workers", "3", "--devices", "3")["devices"] == 3
    with pytest.raises(ValueError, match="--workers 2 and --devices 3 both count .* give one of them"):
        devices_of("--workers", "2", "--devices", "3")


@pytest.mark.parametrize("flag", ["--workers", "--devices"])
@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_count_below_one_is_refused_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit):
        mnist.build_parser().parse_args([flag, value])
    assert "expected a positive whole number" in capsys.readouterr().err


def test_the_accelerator_is_one_of_lightnings_names(capsys):
    with pytest.raises(SystemExit):
        mnist.build_parser().parse_args(["--accelerator", "tpu"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_gpu_run_gets_one_gpu_per_worker(monkeypatch):
    gpus(monkeypatch, 2)
    assert devices_of("--accelerator", "gpu", "--devices", "2") == {"accelerator": "gpu", "devices": 2,
                                                                    "num_nodes": 1}
    assert devices_of("--accelerator", "cuda", "--workers", "1")["accelerator"] == "cuda"
    assert devices_of("--accelerator", "auto") == {"accelerator": "gpu", "devices": 2, "num_nodes": 1}
    gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match="asks for 2 GPUs, and this machine has 1: pass --devices 1"):
        devices_of("--accelerator", "gpu")


def test_no_gpu_is_said_plainly(monkeypatch):
    gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="--accelerator gpu: torch .* sees no CUDA GPU .* leave --accelerator out"):
        devices_of("--accelerator", "gpu", "--devices", "1")
    assert devices_of("--accelerator", "auto")["accelerator"] == "cpu"


class _Built(Exception):
    """Raised by the recording Trainer once built: the fit is not run."""


def test_the_trainer_gets_the_flags(monkeypatch, tmp_path):
    built: list[pl.Trainer] = []
    real = pl.Trainer

    def trainer(**kwargs: Any) -> pl.Trainer:
        built.append(real(**kwargs))
        raise _Built

    class Data(pl.LightningDataModule):
        pass

    monkeypatch.setattr(common.pl, "Trainer", trainer)
    args = mnist.build_parser().parse_args(["--workers", "3", "--mode", "adacomp", "--max-steps", "5", "--quiet",
                                            "--run-dir", str(tmp_path)])
    with pytest.raises(_Built):
        common.train_and_test("mnist", mnist.MnistCNN(), Data(), args)
    (made,) = built
    assert isinstance(made.strategy, AsyncPSStrategy) and made.strategy.mode.name == "adacomp"
    assert made.num_devices == 3 and made.num_nodes == 1 and made.max_steps == 5
    assert all(d.type == "cpu" for d in made.strategy.parallel_devices)


def test_a_gpu_asked_for_where_there_is_none_is_one_line_of_error(monkeypatch, tmp_path):
    gpus(monkeypatch, 0)
    with pytest.raises(SystemExit) as exc:  # before the data are looked for: none are here
        mnist.main(["--accelerator", "gpu", "--no-download", "--data-dir", str(tmp_path / "none")])
    assert str(exc.value.code).startswith("error: --accelerator gpu: torch ") and "no CUDA GPU" in exc.value.code


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU trains on it")
@pytest.mark.timeout(120)
def test_the_mnist_script_on_a_machine_without_a_gpu(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "recipes" / "mnist.py"), "--accelerator", "gpu",
                             "--no-download", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                            timeout=100, env=child_env(), cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error: --accelerator gpu: torch") and "--accelerator out" in result.stderr
