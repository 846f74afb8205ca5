"""results.md and the PNG plots of a benchmark run."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _spread(s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "n/a"
    if s["n"] == 1:
        return f"{_fmt(s['median'])} (1 run)"
    return f"{_fmt(s['median'])} [{_fmt(s['min'])} .. {_fmt(s['max'])}], n={s['n']}"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [f"# Benchmark results ({results['size']})", "",
             f"Command: `{results['command']}` (from the repository root; {results.get('wall_s', 0):.0f} s)."
             + "".join(f" Earlier: `{e['command']}` ({e.get('wall_s', 0):.0f} s, {e['machine']['date']}"
                       + (f", commit {e['machine']['commit']}" if e["machine"].get("commit") else "") + ")."
                       for e in results.get("earlier", [])) + " Each benchmark's own command is in results.json.", "",
             f"Machine: {m['cpu_count']} CPUs ({m['cpu_model']}), torch {m['torch']}, Python {m['python']}, "
             f"ZeroMQ {m['zmq']}, {m['platform']}; {m['date']}; commit {m.get('commit') or 'unknown'}; "
             "load average at start "
             f"{', '.join(f'{x:.2f}' for x in m['load_average_at_start'])}.", "",
             "Each figure: median over repetitions [min .. max], alternated within the run.", "",
             "| benchmark | figure | target | measured | met |", "|---|---|---|---|---|"]
    for name, r in results["benchmarks"].items():
        measured = ("error: " + r["error"]) if "error" in r else _spread(r.get("ratio"))
        lines.append(f"| {name} | {r.get('figure')} | {r.get('target') or 'none'} | {measured} | "
                     f"{ {True: 'yes', False: '**no**', None: '-'}[r.get('met')]} |")
    b = results["benchmarks"]
    if "overhead" in b and "by_batch" in b["overhead"]:
        o = b["overhead"]
        lines += ["", "## Overhead by batch size (asgd / plain Lightning, 1 worker)", "",
                  "| batch | asgd (the figure) | asgd, overlap=True | the PS's time per asgd push, ms | "
                  "... of which on a core, ms |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {_spread(v)} | {_spread(o.get('overlap_by_batch', {}).get(k))} | "
                  f"{_spread(o.get('ps_ms_per_push_by_batch', {}).get(k))} | "
                  f"{_spread(o.get('ps_cpu_ms_per_push_by_batch', {}).get(k))} |" for k, v in o["by_batch"].items()]
    if "stragglers" in b and "asgd_samples_per_s" in b["stragglers"]:
        s = b["stragglers"]
        lines += ["", "## Stragglers", "", f"asgd {_spread(s['asgd_samples_per_s'])} samples/s, DDP "
                  f"{_spread(s['ddp_samples_per_s'])} samples/s. With `Trainer(max_time=...)` stopping both "
                  f"(Lightning's Timer, a broadcast after every batch): asgd / DDP "
                  f"{_spread(s.get('ratio_max_time'))}. {s['method']}"]
    if "adacomp" in b and "rows" in b["adacomp"]:
        a = b["adacomp"]
        lines += ["", "## Bytes pushed and accuracy", "", a["method"], "",
                  f"191x fewer bytes than dense needs a fraction of at most 4 / (6 x 191) = "
                  f"{a['needed_fraction_for_191x']:.4f} with 16-bit offsets and float32 values.", "",
                  "Both ways: every byte the PS received (up) and sent (down), as a link between machines "
                  "would carry them; replies carry only what changed where that is less (delta replies).", "",
                  "| run | bytes pushed | pushes | bytes/push | formula payload/push | asgd bytes / these | "
                  "bytes up | bytes down | down / up | asgd up+down / these | test acc | vs asgd |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in a["rows"]:
            lines.append(f"| {row['name']} | {_fmt(row['push_bytes'])} | {_fmt(row['pushes'])} | "
                         f"{_fmt(row['bytes_per_push'], 6)} | {row['formula_payload_per_push']} | "
                         f"{_fmt(row['asgd_bytes_over_these'])} | {_fmt(row.get('bytes_in'))} | "
                         f"{_fmt(row.get('bytes_out'))} | {_fmt(row.get('down_over_up'))} | "
                         f"{_fmt(row.get('asgd_total_over_these'))} | {_fmt(row['test_acc'])} | "
                         f"{_fmt(row['acc_minus_asgd'], 2)} |")
    if "ps_roundtrip" in b and "ps_roundtrip_s" in b["ps_roundtrip"]:
        p = b["ps_roundtrip"]
        lines += ["", "## PS round trip", "", f"PS {_spread(p['ps_roundtrip_s'])} s, echo "
                  f"{_spread(p['echo_roundtrip_s'])} s per round trip; push {p['push_message_bytes']} bytes. "
                  + p["method"]]
        if "minimal_roundtrip_s" in p:
            lines += ["", "| server | round trip (s) | / minimal server | / echo |", "|---|---|---|---|",
                      f"| PS, raw pusher (the figure) | {_spread(p['ps_raw_roundtrip_s'])} | {_spread(p['ratio'])} | |",
                      f"| minimal server, raw pusher | {_spread(p['minimal_roundtrip_s'])} | | "
                      f"{_spread(p['minimal_over_echo'])} |",
                      f"| PS through PSClient, whole model | {_spread(p['ps_roundtrip_s'])} | | "
                      f"{_spread(p['ratio_over_echo'])} |",
                      f"| the same, 2 fold threads | {_spread(p['ps_2_threads_roundtrip_s'])} | | "
                      f"{_spread(p['ratio_2_threads'])} |",
                      f"| the same, no model (nothing else changed) | {_spread(p['ps_own_reply_roundtrip_s'])} | | "
                      f"{_spread(p['ratio_own_reply'])} |"]
    if "ingest" in b and "updates_per_s" in b["ingest"]:
        g = b["ingest"]
        lines += ["", "## PS ingest (updates/s)", "", "| update / clients | updates/s |", "|---|---|"]
        lines += [f"| {k} | {_spread(v)} |" for k, v in g["updates_per_s"].items()]
        if g.get("dense_2_threads_over_1"):
            lines += ["", f"Dense updates/s, 2 fold threads over 1: {_spread(g['dense_2_threads_over_1'])}."]
        lines += ["", f"Multi-threaded PS: {g['multi_threaded']}. {g['method']}"]
    if "time_to_accuracy" in b and "reps" in b["time_to_accuracy"]:
        t = b["time_to_accuracy"]
        lines += ["", f"## Time to {t['target_acc']:.0%} test accuracy", "", t["method"], "",
                  "| run | seconds to target, in snapshot intervals | runs that missed it | best accuracy | "
                  "samples/s |", "|---|---|---|---|---|"]
        for k, v in t["time_to_target_in_intervals_s"].items():
            lines.append(f"| {k} | {_spread(v)} | {t['missed'].get(k, 0)} | {_spread(t['best_acc'].get(k))} | "
                         f"{_spread(t['samples_per_s'].get(k))} |")
        lines += ["", "| repetition | one process (s) | asgd (s) | asgd / one process | unrounded: one process, "
                  "asgd (s) |", "|---|---|---|---|---|"]
        for p in t["reps"]:
            rounded, raw = p["time_to_target_in_intervals_s"], p["time_to_target_s"]
            ratio = _fmt(p["ratio"]) + (f" ({p['bound']} bound)" if p["bound"] else "")
            lines.append(f"| {p['rep']} | {_fmt(rounded.get('one process'))} | {_fmt(rounded.get('asgd'))} | {ratio} | "
                         f"{_fmt(raw.get('one process'))}, {_fmt(raw.get('asgd'))} |")
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return []
    made = []
    b = results["benchmarks"]
    t = b.get("time_to_accuracy", {})
    if t.get("curves"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, curve in t["curves"].items():
            if curve:
                line, = ax.plot([c[0] for c in curve], [c[1] for c in curve], marker=".", label=name)
                for other in t.get("curves_by_rep", {}).get(name, [])[1:]:  # the other repetitions, thin
                    ax.plot([c[0] for c in other], [c[1] for c in other], color=line.get_color(), lw=0.6,
                            alpha=0.5)
        ax.axhline(t["target_acc"], color="grey", ls="--", lw=0.8)
        every = [c for reps in t.get("curves_by_rep", {}).values() for c in reps] or list(t["curves"].values())
        trained = [a for curve in every for at, a in curve if at > 0]
        if trained:  # the untrained start (about 0.1) would squeeze the curves into a line near the top
            ax.set_ylim(bottom=max(0.0, min(trained) - 0.02))
        ax.set(xlabel="training wall time (s)", ylabel="test accuracy",
               title="Fashion-MNIST, recipe CNN (thin lines: other repetitions)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "time_to_accuracy.png", dpi=100)
        plt.close(fig)
        made.append("time_to_accuracy.png")
    a = b.get("adacomp", {})
    if a.get("rows"):
        rows = [r for r in a["rows"] if r["push_bytes"] and r["test_acc"] is not None]
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in rows:
            ax.scatter(r["push_bytes"], r["test_acc"])
            ax.annotate(r["name"], (r["push_bytes"], r["test_acc"]), fontsize=7)
        ax.set_xscale("log")
        ax.set(xlabel="bytes pushed over the run (on the wire)", ylabel="test accuracy", title="Bytes and accuracy")
        fig.tight_layout()
        fig.savefig(out / "adacomp_bytes.png", dpi=100)
        plt.close(fig)
        made.append("adacomp_bytes.png")
    ratios = [(n, r["ratio"]) for n, r in b.items() if (r.get("ratio") or {}).get("median") is not None]
    if ratios:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(ratios))
        med = [r["median"] for _, r in ratios]
        err = [[r["median"] - r["min"] for _, r in ratios], [r["max"] - r["median"] for _, r in ratios]]
        ax.bar(xs, med, yerr=err, capsize=3)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [n for n, _ in ratios], rotation=30, ha="right")
        ax.set(ylabel="ratio (median, min..max)", title="Benchmark figures")
        fig.tight_layout()
        fig.savefig(out / "ratios.png", dpi=100)
        plt.close(fig)
        made.append("ratios.png")
    return made


def write_report(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    made = plots(results, out)
    text = markdown(results)
    if made:
        text += "\n" + "\n".join(f"![{m}]({m})" for m in made) + "\n"
    (out / "results.md").write_text(text)
