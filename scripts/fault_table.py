"""Run the fault tests and write their figures into the fault table of docs/faults.md.

    .venv/bin/python scripts/fault_table.py    # runs `pytest -m faults`, then rewrites the table
    .venv/bin/python scripts/fault_table.py --tests tests/test_identity.py    # those tests' rows only

With ``--tests`` only the fault tests named run (one process, ``-n 0``), and their rows go into the
table as it is: a row whose fault text is the same is replaced, a new one is added at the end.

Each fault test records one row through the ``fault_report`` fixture (tests/conftest.py) into the
file named by PLUG_ASGD_FAULT_REPORT: what was injected, how many times, how many were handled
(survived, or refused with an error reply), the pushes lost, and the wall time the recovery took.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- fault-table:begin -->", "<!-- fault-table:end -->"


def run_fault_tests(report: Path, tests: list[str] | None = None) -> int:
    env = {**os.environ, "PLUG_ASGD_FAULT_REPORT": str(report)}
    command = [sys.executable, "-m", "pytest", "-m", "faults", "-q", "-p", "no:cacheprovider"]
    if tests:
        command += ["-n", "0", *tests]
    return subprocess.run(command, cwd=ROOT, env=env, timeout=1800).returncode


def render_row(r: dict) -> str:
    recovery = "-" if r.get("recovery_s") is None else f"{r['recovery_s']:.2f}"
    return (f"| {r['fault']} | {r['injected']} | {r['handled']} | {r['pushes_lost']} | {recovery} | "
            f"{r.get('detail', '')} |")


def render(rows: list[dict]) -> str:
    lines = ["| fault injected | times | handled | pushes lost | recovery (s) | what happened |",
             "|---|---:|---:|---:|---:|---|"]
    lines += [render_row(r) for r in rows]
    lines.append("")
    lines.append("Made by `.venv/bin/python scripts/fault_table.py`: every row is one test of `pytest -m faults`.")
    return "\n".join(lines)


def merge(block: str, rows: list[dict]) -> str:
    """The table ``block`` with ``rows`` in it: a row of the same fault text replaced, a new one added after the
    last row; the rest as it was."""
    lines = block.strip("\n").split("\n")
    fault = {r["fault"]: render_row(r) for r in rows}
    last = max(i for i, line in enumerate(lines) if line.startswith("| "))
    table = [fault.pop(line[2:].split(" | ")[0], line) for line in lines[:last + 1]]
    return "\n".join([*table, *fault.values(), *lines[last + 1:]])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", "--readme", dest="doc", type=Path, default=ROOT / "docs" / "faults.md",
                        help="the Markdown file whose fault-table block is rewritten (default: docs/faults.md)")
    parser.add_argument("--tests", nargs="+", metavar="TEST",
                        help="run only these fault tests (files or node ids, one process) and put their rows into "
                             "the table as it is, instead of making the whole table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "faults.jsonl"
        code = run_fault_tests(report, args.tests)
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
    block, tail = rest.split(END, 1)
    table = merge(block, rows) if args.tests else render(rows)
    args.doc.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
