"""results.md and one accuracy-against-time plot per link rate, for ``bench.slowlink``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import _fmt


def _kb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1e3:.1f}"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    size = results["size"]
    # which command made each run: merged files (--merge) hold runs of several; a run without one is the first's
    commands = list(dict.fromkeys([e["command"] for e in results.get("earlier", [])] + [results["command"]]))
    lines = [f"# Slow links: time to {results['target_acc']:.0%} Fashion-MNIST test accuracy", "",
             "Commands (the `cmd` column; from the repository root, with `PYTHONPATH=.`): "
             + "; ".join(f"{i}. `{c}`" for i, c in enumerate(commands, 1)) + ".", "",
             f"Machine: {m['cpu_count']} CPUs ({m['cpu_model']}), torch {m['torch']}, {m['platform']}; last command "
             f"{m['date']}, commit {m.get('commit')}"
             + "".join(f"; earlier `{e['command']}` {e['machine']['date']}, commit {e['machine'].get('commit')}"
                       for e in results.get("earlier", [])) + ".", "",
             f"Every run: batch {results['batch_size']} per worker, Adam 1e-3, stopped after {size['max_steps']} steps "
             f"or {size['time_limit_s']:g} s of training or {size['epochs']} epoch(s); rank 0's weights snapshotted "
             f"every {size['snapshot_s']:g} s (for our modes, beside them the central model as rank 0 last received "
             "it, which validation, test and checkpoints load: its own column) and evaluated on "
             f"{size['test_subset'] or 'all'} test images after "
             "the fit. Bytes: each worker host's interface counters (tx = up, rx = down) over the launch, summed "
             "over the workers, over the samples they trained on; `strategy` is the client's own count "
             f"(payload and headers of its messages). DDP's formula, 2 (n-1)/n x {results['model_bytes']:,} "
             f"model bytes per step over the batch: {_kb(results['ddp_formula_up_per_sample'])} kB per sample "
             "each way. "
             + (f"Hosts pinned (`taskset`): each worker host, and the one process, to {size['cores_per_host']} "
                "core(s) of its own; the PS's host to the cores left, or floating over all when none are left."
                if size.get("cores_per_host") else
                "Hosts not pinned: the workers and the PS share the machine's cores, the one process has them all."),
             ""]
    for rate, r in results["rates"].items():
        p = r["probe"]
        tries = f"the fastest of {len(p['tries_mbit'])} TCP transfers" if "tries_mbit" in p else "a TCP transfer"
        lines += [f"## {rate} Mbit/s (htb); {tries} measured {p['mbit_per_s']:.1f} Mbit/s of payload", "",
                  f"| scheme | time to {results['target_acc']:.0%} (s) | the central model's (s) | final acc "
                  "| best acc | samples | samples/s | up kB/sample | down kB/sample | strategy up/down kB/sample "
                  "| cmd |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, x in r["runs"].items():
            cmd = commands.index(x.get("command", commands[0])) + 1
            if "error" in x:
                lines.append(f"| {name} | error: {x['error']} | | | | | | | | | {cmd} |")
                continue
            rate_s = x["samples"] / x["train_s"] if x.get("train_s") else None
            strategy = (f"{_kb(x['strategy_up_per_sample'])} / {_kb(x['strategy_down_per_sample'])}"
                        if "strategy_up_per_sample" in x else "-")
            central = _fmt(x["central_time_to_target_s"]) if "central_time_to_target_s" in x else "-"
            lines.append(f"| {name} | {_fmt(x['time_to_target_s'])} | {central} | {_fmt(x['final_acc'])} "
                         f"| {_fmt(x['best_acc'])} "
                         f"| {x['samples']} | {_fmt(rate_s)} | {_kb(x['up_per_sample'])} | "
                         f"{_kb(x['down_per_sample'])} | {strategy} | {cmd} |")
        hm = r["runs"].get("hivemind", {})
        if "hivemind_config" in hm:
            lines += ["", f"hivemind {hm['hivemind_version']}: `hivemind.Optimizer(batch_size_per_step="
                      f"{results['batch_size']}, " + ", ".join(f"{k}={v}" for k, v in hm["hivemind_config"].items())
                      + ")` (hivemind's quickstart), Adam 1e-3 inside; peer 0's weights snapshotted."]
        lines.append("")
    return "\n".join(lines)


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """One PNG per rate: test accuracy against training time, one line per scheme; none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for rate, r in results["rates"].items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, x in r["runs"].items():
            curve = x.get("curve") or []
            if curve:
                (line,) = ax.plot([c[0] for c in curve], [c[1] for c in curve], marker=".", label=name)
                central = x.get("central_curve") or []
                if central:  # the model validation, test and checkpoints load, in the same colour
                    ax.plot([c[0] for c in central], [c[1] for c in central], ls=":", color=line.get_color(),
                            label=f"{name} (central)")
        ax.axhline(results["target_acc"], color="grey", lw=0.6, ls="--")
        ax.set(xlabel="training time (s)", ylabel="test accuracy", title=f"{rate} Mbit/s links, 2 workers")
        ax.legend(fontsize=8)
        name = f"slowlink_{rate}mbit.png"
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        made.append(name)
    return made


def write_report(results: dict[str, Any], out: Path) -> None:
    made = plots(results, out)
    text = markdown(results) + "".join(f"\n![{p}]({p})\n" for p in made)
    (out / "results.md").write_text(text)
