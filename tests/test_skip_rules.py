"""What may skip where: a test missing something the machine should have skips elsewhere, fails in CI."""

from __future__ import annotations

import pytest

from tests.conftest import REQUIRE_ALL, skip_unless_required


def test_a_missing_prerequisite_skips_with_its_reason_outside_ci(monkeypatch):
    monkeypatch.delenv(REQUIRE_ALL, raising=False)
    with pytest.raises(pytest.skip.Exception, match="cannot make network namespaces"):
        skip_unless_required("cannot make network namespaces here")


def test_a_missing_prerequisite_fails_in_ci(monkeypatch):
    monkeypatch.setenv(REQUIRE_ALL, "1")
    with pytest.raises(pytest.fail.Exception, match=r"cannot make network namespaces here \(PLUG_ASGD_REQUIRE_DATA=1"):
        skip_unless_required("cannot make network namespaces here")
