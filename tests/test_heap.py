"""A worker's heap kept (plug_asgd.compressors.heap): freed arrays of a push's size reuse their pages, counted by the
process's minor page faults, in fresh processes (glibc's settings are the process's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

# four arrays of 11.2 MB made and freed (a 2.8M-parameter tensor's decoding and its temporaries) at two pushes,
# the second one counted
PROBE = r"""
import json, resource, sys
import numpy as np
from plug_asgd.compressors.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def push():
    a = np.ones(2_800_000, dtype=np.float32)
    b = a * 2.0
    c = a + b
    d = c - a
    del a, b, c, d
push()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
push()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def probe(arg: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, arg], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env}, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_pushs_arrays_reuse_their_pages_once_the_heap_is_kept():
    default = probe("default")
    kept = probe("keep")
    # by default glibc returns part of the 4 x 2,734 pages of 4 KiB at the first push's frees (its trim threshold
    # follows the largest block freed, 11.2 MB, and 45 MB are free at the top) and faults them in again at the
    # second (2,250 with glibc 2.36): at least a third of one array's
    assert default["faults"] >= 1_000, default
    assert kept["kept"] is True and kept["faults"] < 100, kept


def test_the_users_own_malloc_settings_and_the_opt_out_stand():
    assert probe("keep", MALLOC_TRIM_THRESHOLD_="1000000")["kept"] is False
    assert probe("keep", PLUG_ASGD_KEEP_HEAP="0")["kept"] is False
