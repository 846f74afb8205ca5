"""Both Lightning namespaces: ``import lightning as L`` and ``import pytorch_lightning as pl`` each get
the strategy, the callbacks and the strategy names, in real processes that import only that one."""

from __future__ import annotations

import json
import re

import pytest

from plug_asgd import namespaces
from tests.conftest import PYTHON, ROOT

STEPS = 2 * 2 * 16  # 2 workers x 2 epochs x 16 batches


@pytest.mark.parametrize("how", ["object", "name"])
@pytest.mark.parametrize("namespace", ["lightning", "pytorch_lightning"])
def test_a_two_worker_fit_with_the_callbacks_under_each_namespace(procs, tmp_path, namespace, how):
    code, out = procs.run([PYTHON, "tests/scripts/namespace_fit.py", namespace, how, str(tmp_path)], timeout=120)
    assert code == 0, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    binding = namespaces.BINDINGS["lightning.pytorch" if namespace == "lightning" else "pytorch_lightning"]
    assert result["strategy"] == f"{binding}.AsyncPSStrategy"
    assert result["callbacks"] == [f"{binding}.{name}" for name in ("CommunicationMonitor", "PSCheckpoint",
                                                                    "Supervisor")]
    assert result["is_plug_asgd"] and not result["other_namespace_imported"]
    assert result["ps_version"] == STEPS and result["test_acc"] >= 0.9
    assert result["supervised"] >= 1 and (tmp_path / "sup" / "supervisor.jsonl").exists()
    assert list((tmp_path / "ckpt").iterdir())
    assert sorted(p.name for p in (tmp_path / "comm").iterdir()) == ["worker0.jsonl", "worker1.jsonl"]


def test_the_two_bindings_are_one_file_with_the_namespace_renamed():
    def code(name: str) -> str:
        text = (ROOT / "plug_asgd" / name).read_text()
        return text[text.index('"""', 3) + 3:]  # after the docstring

    renamed = re.sub(r"\bpytorch_lightning\b", "lightning.pytorch", code("pytorch_lightning.py"))
    assert renamed == code("lightning.py")


def test_importing_plug_asgd_imports_no_lightning(procs):
    code, out = procs.run([PYTHON, "-c", "import sys, plug_asgd.ps_server; "
                           "print(sorted(m for m in sys.modules if 'lightning' in m or m == 'torch'))"], timeout=60)
    assert code == 0 and out.strip() == "[]", out


def test_both_namespaces_imported_asks_for_an_explicit_class(procs):
    code, out = procs.run([PYTHON, "-c", "import lightning, pytorch_lightning, plug_asgd; plug_asgd.AsyncPSStrategy()"],
                          timeout=60)
    assert code != 0 and "plug_asgd.pytorch_lightning" in out and "plug_asgd.lightning" in out, out


def test_a_class_written_once_is_each_namespace_class(procs):
    code, out = procs.run([PYTHON, "-c", "import lightning, pytorch_lightning, plug_asgd.lightning as a, "
                           "plug_asgd.pytorch_lightning as b; from plug_asgd import Supervisor, AsyncPSStrategy; "
                           "from lightning.pytorch.callbacks import Callback as LC; "
                           "from pytorch_lightning.callbacks import Callback as PC; "
                           "print(isinstance(a.Supervisor([]), (Supervisor, LC)), isinstance(b.Supervisor([]), PC), "
                           "isinstance(a.AsyncPSStrategy(), AsyncPSStrategy))"], timeout=60)
    assert code == 0 and out.split()[-3:] == ["True", "True", "True"], out
