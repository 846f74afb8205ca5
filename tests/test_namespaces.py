"""Both Lightning namespaces: ``import lightning as L`` and ``import pytorch_lightning as pl`` each get
the strategy, the callbacks and the strategy names, in real processes that import only that one."""

from __future__ import annotations

import json
import re

import pytest

from plug_asgd.lightning_bridge import namespaces
from tests.conftest import PYTHON, ROOT, free_port, run_to_end

STEPS = 2 * 2 * 16  # 2 workers x 2 epochs x 16 batches


# How each namespace's launch passes the strategy. pytorch_lightning's fit by object with the three
# callbacks is the recipe's own (test_callbacks), so its launch fits by name only.
FITS = {"lightning": ["name", "object"], "pytorch_lightning": ["name"]}


@pytest.fixture(scope="module", params=list(FITS))
def fits(request, tmp_path_factory):
    """The fits of FITS[namespace], one after another, in one launch that imports only this namespace."""
    out = tmp_path_factory.mktemp(request.param)
    run_to_end([PYTHON, "tests/scripts/namespace_fit.py", request.param, str(free_port()), str(out),
                *FITS[request.param]], timeout=150)
    return request.param, out


@pytest.mark.integration
def test_two_worker_fits_with_the_callbacks_under_each_namespace(fits):
    namespace, root = fits
    binding = namespaces.BINDINGS["lightning.pytorch" if namespace == "lightning" else "pytorch_lightning"]
    for how in FITS[namespace]:
        out = root / how
        result = json.loads((out / "result.json").read_text())
        assert result["strategy"] == f"{binding}.AsyncPSStrategy", how
        assert result["callbacks"] == [f"{binding}.{name}" for name in ("CommunicationMonitor", "PSCheckpoint",
                                                                        "Supervisor")], how
        assert result["is_plug_asgd"] and not result["other_namespace_imported"], (how, result)
        assert result["ps_version"] == STEPS and result["test_acc"] >= 0.9, (how, result)
        assert result["supervised"] >= 1 and (out / "sup" / "supervisor.jsonl").exists(), (how, result)
        assert list((out / "ckpt").iterdir()), how
        assert sorted(p.name for p in (out / "comm").iterdir()) == ["worker0.jsonl", "worker1.jsonl"], how


def test_the_two_bindings_are_one_file_with_the_namespace_renamed():
    def code(name: str) -> str:
        text = (ROOT / "plug_asgd" / name).read_text()
        return text[text.index('"""', 3) + 3:]  # after the docstring

    renamed = re.sub(r"\bpytorch_lightning\b", "lightning.pytorch", code("pytorch_lightning.py"))
    assert renamed == code("lightning.py")


def test_importing_plug_asgd_imports_no_lightning(procs):
    code, out = procs.run([PYTHON, "-c", "import sys, plug_asgd.ps.embedded; "
                           "print(sorted(m for m in sys.modules if m == 'torch' or "
                           "('lightning' in m and not m.startswith('plug_asgd'))))"], timeout=60)
    assert code == 0 and out.strip() == "[]", out


def test_with_both_namespaces_imported_each_class_is_its_own_and_the_plain_one_asks_which(procs):
    code, out = procs.run([PYTHON, "-c", "import lightning, pytorch_lightning, plug_asgd.lightning as a, "
                           "plug_asgd.pytorch_lightning as b; from plug_asgd import Supervisor, AsyncPSStrategy; "
                           "from lightning.pytorch.callbacks import Callback as LC; "
                           "from pytorch_lightning.callbacks import Callback as PC; "
                           "print(isinstance(a.Supervisor([]), (Supervisor, LC)), isinstance(b.Supervisor([]), PC), "
                           "isinstance(a.AsyncPSStrategy(), AsyncPSStrategy)); AsyncPSStrategy()"], timeout=60)
    assert out.split("\n")[0].split() == ["True", "True", "True"], out
    assert code != 0 and "plug_asgd.pytorch_lightning" in out and "plug_asgd.lightning" in out, out
