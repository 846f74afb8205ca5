"""The package as a user gets it: ``python -m build`` makes an sdist and a wheel, and the wheel installed in a fresh
virtual environment runs ``plug-asgd`` and a 2-worker fit, with no editable install nor the repository on the path.

The fresh environment gets no torch of its own (no download): a ``.pth`` file lists the project environment's
site-packages as a plain path line, which puts its packages on ``sys.path`` without running its own ``.pth`` files,
so the project's editable install is not seen; the test checks that ``plug_asgd`` comes from the wheel. Every
command runs from a temporary folder, never the repository, and is killed past its timeout.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import plug_asgd
from tests.conftest import child_env, kill_group, skip_unless_required

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parent.parent
VERSION = plug_asgd.__version__
# what .gitignore keeps out of a checkout, and what the build would not take anyway
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__", "*.egg-info", "build", "dist",
                                    ".pytest_cache", ".ruff_cache", "lightning_logs", "work")

FIT = '''\
"""A user's script: a tiny model, two CPU workers under AsyncPSStrategy, a few steps on random tensors."""
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import plug_asgd
from plug_asgd import AsyncPSStrategy


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
        return DataLoader(data, batch_size=8)


if __name__ == "__main__":
    strategy = AsyncPSStrategy()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny())
    if trainer.is_global_zero:
        print("plug_asgd from", plug_asgd.__file__)
        print("PS version", strategy.ps_stats()["version"], flush=True)
'''


def run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a command to its end in its own session (its group killed past ``timeout``); fail where it fails."""
    env = {k: v for k, v in child_env(COLUMNS="80", NO_COLOR="1").items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{args} did not finish within {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{args} exited with {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    """The sdist and the wheel ``python -m build`` makes of a copy of the checkout (the wheel built from the sdist)."""
    if importlib.util.find_spec("build") is None:
        skip_unless_required("the build package is missing: pip install -c constraints.txt build (a dev extra)")
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE, symlinks=True)
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(source)], tmp, 180)
    (sdist,) = (tmp / "dist").glob("*.tar.gz")
    (wheel,) = (tmp / "dist").glob("*.whl")
    return sdist, wheel


def test_the_wheel_holds_the_package_only(dists):
    sdist, wheel = dists
    assert wheel.name == f"plug_asgd-{VERSION}-py3-none-any.whl" and sdist.name == f"plug_asgd-{VERSION}.tar.gz"
    names = zipfile.ZipFile(wheel).namelist()
    info = f"plug_asgd-{VERSION}.dist-info"
    assert {n.split("/")[0] for n in names} == {"plug_asgd", info}, sorted({n.split("/")[0] for n in names})
    assert "plug_asgd/cli/app.py" in names and "plug_asgd/recipes/mnist.py" in names
    assert {"plug_asgd/compressors/kernels/selection.c", "plug_asgd/compressors/kernels/quantize.c"} <= set(names)
    assert f"{info}/licenses/LICENSE" in names
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "plug-asgd = plug_asgd.cli.app:app" in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert f"Version: {VERSION}\n" in metadata and "License-Expression: BSD-3-Clause" in metadata


def test_the_sdist_holds_the_sources_and_the_license(dists):
    sdist, _ = dists
    root = f"plug_asgd-{VERSION}"
    names = set(tarfile.open(sdist).getnames())
    for name in ("pyproject.toml", "LICENSE", "README.md", "plug_asgd/__init__.py", "plug_asgd/cli/app.py"):
        assert f"{root}/{name}" in names, name
    assert not [n for n in names if n.split("/")[1:2] in (["bench"], ["harness"], ["recipes"], ["runs"])]


def test_the_wheel_installed_in_a_fresh_environment_runs(dists, tmp_path):
    _, wheel = dists
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, 60)
    python = venv / "bin" / "python"
    # pip of the project environment installs into the fresh one; nothing else is on its path yet
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
         "--disable-pip-version-check", str(wheel)], tmp_path, 120)
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path,
                    30).stdout.strip())
    project = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "project_dependencies.pth").write_text("".join(f"{p}\n" for p in project))

    where = run([str(python), "-c", "import plug_asgd; print(plug_asgd.__file__)"], tmp_path, 60).stdout.strip()
    assert Path(where).is_relative_to(site) and not Path(where).is_relative_to(REPO), where
    version = run([str(venv / "bin" / "plug-asgd"), "--version"], tmp_path, 60).stdout
    assert version == f"plug-asgd {VERSION}\n"
    help_text = run([str(venv / "bin" / "plug-asgd"), "--help"], tmp_path, 60).stdout
    assert "serve-ps" in help_text and "--version" in help_text

    (tmp_path / "fit.py").write_text(FIT)
    fit = run([str(python), "fit.py"], tmp_path, 150)
    print(fit.stdout)
    assert f"plug_asgd from {site}" in fit.stdout
    versions = [int(line.split()[-1]) for line in fit.stdout.splitlines() if line.startswith("PS version ")]
    assert versions == [6], fit.stdout + fit.stderr[-3000:]  # asgd: each of 2 workers' 3 pushes is an update
