"""Run the fault tests and write their figures into the fault table of docs/faults.md.

    .venv/bin/python scripts/fault_table.py    # runs `pytest -m faults`, then rewrites the table

Each fault test records one row through the ``fault_report`` fixture (tests/conftest.py) into the
file named by PLUG_ASGD_FAULT_REPORT: what was injected, how many times, how many were handled
(survived, or refused with an error reply), the pushes lost, and the wall time the recovery took.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- fault-table:begin -->", "<!-- fault-table:end -->"


def run_fault_tests(report: Path) -> int:
    env = {**os.environ, "PLUG_ASGD_FAULT_REPORT": str(report)}
    return subprocess.run([sys.executable, "-m", "pytest", "-m", "faults", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, timeout=1800).returncode


def render(rows: list[dict]) -> str:
    lines = ["| fault injected | times | handled | pushes lost | recovery (s) | what happened |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        recovery = "-" if r.get("recovery_s") is None else f"{r['recovery_s']:.2f}"
        lines.append(f"| {r['fault']} | {r['injected']} | {r['handled']} | {r['pushes_lost']} | {recovery} | "
                     f"{r.get('detail', '')} |")
    stamp = time.strftime("%Y-%m-%d")
    lines.append("")
    lines.append(f"Made by `.venv/bin/python scripts/fault_table.py` on {stamp} ({platform.machine()}, "
                 f"{os.cpu_count()} cores): every row is one test of `pytest -m faults`.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", "--readme", dest="doc", type=Path, default=ROOT / "docs" / "faults.md",
                        help="the Markdown file whose fault-table block is rewritten (default: docs/faults.md)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.jsonl"
        code = run_fault_tests(report)
        if code != 0:
            print(f"the fault tests failed (pytest exit code {code}): the table in {args.doc} is left as it was",
                  file=sys.stderr)
            return code
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    if not rows:
        print("no fault test recorded a row: is PLUG_ASGD_FAULT_REPORT reaching the tests?", file=sys.stderr)
        return 1
    text = args.doc.read_text()
    if BEGIN not in text or END not in text:
        print(f"{args.doc} has no {BEGIN} ... {END} block to fill", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    args.doc.write_text(f"{head}{BEGIN}\n{render(rows)}\n{END}{tail}")
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
