"""The docs site: ``mkdocs build --strict`` of ``mkdocs.yml`` passes, with no warning, and a broken link fails it.

The build (mkdocs-material, mkdocstrings: the ``dev`` extra) turns every warning into a failure: a link between the
pages that leads nowhere, an anchor no heading has, a link beyond docs/ to a file the repository does not hold or
to a heading it lacks (``scripts/mkdocs_hooks.py``), an API page's object without a docstring.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, child_env

pytestmark = pytest.mark.integration  # mkdocs runs as a process of its own


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=ROOT, env=child_env(NO_MKDOCS_2_WARNING="1"),
                          capture_output=True, text=True, timeout=110)


@pytest.mark.timeout(120)
def test_the_site_builds_strictly_without_a_warning(tmp_path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert not [line for line in out.splitlines() if line.startswith(("WARNING", "ERROR"))], out
    # README.md is the home page, with its figure copied in; the API reference is made from the docstrings
    home = (tmp_path / "site" / "index.html").read_text()
    assert "When it beats DDP" in home and "_repo/bench/results/slowlink" in home
    assert (tmp_path / "site" / "_repo" / "bench" / "results" / "slowlink" / "pinned_100mbit" /
            "slowlink_100mbit.png").is_file()
    api = (tmp_path / "site" / "api" / "strategy" / "index.html").read_text()
    assert "resume_from" in api and "ps_keys" in api


@pytest.mark.timeout(120)
def test_a_link_beyond_docs_to_a_missing_file_or_heading_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    results = Path(os.path.relpath(ROOT / "bench" / "results" / "README.md", docs))
    (docs / "index.md").write_text("# A page\n\n"
                                   f"[there]({results.as_posix()}#the-readmes-two-commands)\n\n"
                                   f"[no such heading]({results.as_posix()}#no-such-heading)\n\n"
                                   "[no such file](../bench/no_such_file.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\ndocs_dir: {docs}\nhooks:\n  - {ROOT / 'scripts' / 'mkdocs_hooks.py'}\n")
    done = build(config, tmp_path / "site")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    warnings = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert any("has no heading with the anchor #no-such-heading" in w for w in warnings), out
    assert any("../bench/no_such_file.md, which is not a file of the repository" in w for w in warnings), out
    assert not any("#the-readmes-two-commands" in w for w in warnings), out
