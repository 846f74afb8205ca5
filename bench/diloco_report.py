"""``bench.diloco``'s summaries against issue 58's targets, its results.md and its figure (validation loss against
wall time and against the bytes on the worker hosts' links, one PNG per rate).

Each seed's target loss is the final validation loss of its DDP run at that rate. A run's time to it is the first
snapshot at or below it. A ratio of two times pairs the runs of one seed; where one of the two never reached the
loss, its whole run bounds its time from below, so the ratio is a bound (``at_most`` where the denominator's is,
``at_least`` where the numerator's is) and counts for the target only where the bound decides it. A target is met
where more than half of the seeds meet it (for 3 seeds: where the median does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import spread, summary, write_json

# issue 58's targets: (figure, "<=" or ">=", target, the only rate it is set at, or None: every rate)
TARGETS: dict[str, tuple[str, str, float, float | None]] = {
    "loss_diloco_over_ddp": ("diloco's validation loss at DDP's samples / DDP's final", "<=", 1.02, None),
    "loss_diloco_m05_over_ddp": ("the same, diloco with the outer Nesterov at momentum 0.5", "<=", 1.02, None),
    "loss_diloco_lr1_m05_over_ddp": ("the same, diloco with the outer Nesterov at lr 1.0, momentum 0.5", "<=", 1.02,
                                     None),
    "time_diloco_over_ddp": ("time to DDP's final loss, diloco / DDP", "<=", 0.25, 100.0),
    "bytes_ddp_over_diloco": ("bytes per sample on the worker links, DDP / diloco", ">=", 100.0, None),
    "time_async_over_diloco_slow": ("time to DDP's loss with w1 slowed, async_diloco / diloco", "<=", 0.7, None),
    "time_async_sgd_over_diloco_slow": ("the same, async_diloco with the outer SGD (lr 1.0, no momentum) / diloco",
                                        "<=", 0.7, None),
    "time_diloco_over_hivemind": ("time to DDP's loss, diloco / hivemind", "<=", 0.5, None),
    "time_async_sgd_f2_over_diloco_slow_f2": ("the same, both streaming (fragments=2)", "<=", 0.7, None),
    "time_async_sgd_f2_over_diloco_slow": ("the same, async_diloco streaming (fragments=2) / diloco whole", "<=", 0.7,
                                           None),
    "time_async_m05_over_diloco_slow": ("the same, async_diloco with the delayed Nesterov at momentum 0.5 / diloco",
                                        "<=", 0.7, None),
    "time_async_m07_over_diloco_slow": ("the same, async_diloco with the delayed Nesterov at momentum 0.7 / diloco",
                                        "<=", 0.7, None),
    "time_async_nolookahead_over_diloco_slow": ("the same, async_diloco without the momentum lookahead / diloco",
                                                "<=", 0.7, None),
    "time_async_f2_over_diloco_slow": ("the same, async_diloco streaming (fragments=2) / diloco whole", "<=", 0.7,
                                       None),
    "time_async_f2_over_diloco_slow_f2": ("the same, both streaming (fragments=2)", "<=", 0.7, None),
    "time_async_overlap_over_diloco_slow": ("the same, async_diloco with overlap=True / diloco", "<=", 0.7, None),
    "time_async_overlap_over_diloco_slow_overlap": ("the same, both with overlap=True", "<=", 0.7, None),
}
# (numerator, denominator, the runs' figure) of each ratio
RATIOS: dict[str, tuple[str, str, str]] = {
    "loss_diloco_over_ddp": ("diloco", "ddp", "loss"),
    "loss_diloco_m05_over_ddp": ("diloco-m05", "ddp", "loss"),
    "loss_diloco_lr1_m05_over_ddp": ("diloco-lr1-m05", "ddp", "loss"),
    "time_diloco_over_ddp": ("diloco", "ddp", "time"),
    "bytes_ddp_over_diloco": ("ddp", "diloco", "bytes"),
    "time_async_over_diloco_slow": ("async_diloco-slow", "diloco-slow", "time"),
    "time_async_sgd_over_diloco_slow": ("async_diloco-slow-sgd", "diloco-slow", "time"),
    "time_diloco_over_hivemind": ("diloco", "hivemind", "time"),
    "time_async_sgd_f2_over_diloco_slow_f2": ("async_diloco-slow-sgd-f2", "diloco-slow-f2", "time"),
    "time_async_sgd_f2_over_diloco_slow": ("async_diloco-slow-sgd-f2", "diloco-slow", "time"),
    "time_async_m05_over_diloco_slow": ("async_diloco-slow-m05", "diloco-slow", "time"),
    "time_async_m07_over_diloco_slow": ("async_diloco-slow-m07", "diloco-slow", "time"),
    "time_async_nolookahead_over_diloco_slow": ("async_diloco-slow-nolookahead", "diloco-slow", "time"),
    "time_async_f2_over_diloco_slow": ("async_diloco-slow-f2", "diloco-slow", "time"),
    "time_async_f2_over_diloco_slow_f2": ("async_diloco-slow-f2", "diloco-slow-f2", "time"),
    "time_async_overlap_over_diloco_slow": ("async_diloco-slow-overlap", "diloco-slow", "time"),
    "time_async_overlap_over_diloco_slow_overlap": ("async_diloco-slow-overlap", "diloco-slow-overlap", "time"),
}
LABELS = {"ddp": "DDP (gloo)", "diloco": "diloco", "diloco-slow": "diloco, w1 slowed",
          "diloco-m05": "diloco, outer Nesterov momentum 0.5", "diloco-lr1-m05": "diloco, outer Nesterov lr 1.0 m 0.5",
          "async_diloco-slow": "async_diloco, w1 slowed",
          "async_diloco-slow-sgd": "async_diloco, w1 slowed, outer SGD lr 1.0",
          "hivemind": "hivemind (local updates + averaging)", "diloco-slow-f2": "diloco, w1 slowed, fragments=2",
          "async_diloco-slow-sgd-f2": "async_diloco, w1 slowed, outer SGD lr 1.0, fragments=2",
          "async_diloco-slow-m05": "async_diloco, w1 slowed, delayed Nesterov momentum 0.5",
          "async_diloco-slow-m07": "async_diloco, w1 slowed, delayed Nesterov momentum 0.7",
          "async_diloco-slow-nolookahead": "async_diloco, w1 slowed, without the momentum lookahead",
          "async_diloco-slow-f2": "async_diloco, w1 slowed, fragments=2",
          "async_diloco-slow-overlap": "async_diloco, w1 slowed, overlap=True",
          "diloco-slow-overlap": "diloco, w1 slowed, overlap=True"}
COLORS = {"ddp": "black", "diloco": "tab:blue", "diloco-m05": "darkviolet", "diloco-lr1-m05": "lime",
          "diloco-slow": "tab:cyan", "async_diloco-slow": "tab:orange",
          "async_diloco-slow-sgd": "tab:red", "hivemind": "tab:green", "diloco-slow-f2": "tab:purple",
          "async_diloco-slow-sgd-f2": "tab:brown", "async_diloco-slow-m05": "tab:pink",
          "async_diloco-slow-m07": "tab:olive", "async_diloco-slow-nolookahead": "tab:gray",
          "async_diloco-slow-f2": "gold", "async_diloco-slow-overlap": "teal",
          "diloco-slow-overlap": "navy"}


def time_to(curve: list[list[Any]], loss: float | None) -> float | None:
    """The first snapshot's time at or below ``loss``; None where none is (or no loss is given).

    Args:
        curve: ``[time, loss, ...]`` rows in time order.
        loss: the target loss.
    """
    if loss is None:
        return None
    return next((row[0] for row in curve if row[1] <= loss), None)


def pair_ratio(a: dict[str, Any], b: dict[str, Any], figure: str) -> tuple[float | None, str | None]:
    """Run ``a``'s figure over run ``b``'s, and what it is: ``exact``, ``at_most``, ``at_least``, or None.

    Args:
        a: the numerator's run (with ``time_to_target_s`` set by :func:`summarize`).
        b: the denominator's run.
        figure: ``time`` (to the target loss), ``loss`` (a's at DDP's samples over b's final) or ``bytes`` (per
            sample).
    """
    if figure == "loss":
        loss = a.get("equal_samples_loss")
        return (loss / b["final_loss"], "exact") if loss is not None else (None, None)
    if figure == "bytes":
        return a["bytes_per_sample"] / b["bytes_per_sample"], "exact"
    ta, tb = a.get("time_to_target_s"), b.get("time_to_target_s")
    if ta is not None and tb is not None:
        return (ta / tb, "exact") if tb > 0 else (None, None)
    if ta is not None:  # b never got there: its time is past its run's end
        return ta / b["train_s"], "at_most"
    if tb is not None and tb > 0:
        return a["train_s"] / tb, "at_least"
    return None, None


def _verdict(value: float | None, kind: str | None, op: str, target: float) -> bool | None:
    """Whether one seed's ratio meets the target: True, False, or None where its bound does not decide."""
    if value is None:
        return None
    meets = value <= target if op == "<=" else value >= target
    if kind == "exact" or (kind == "at_most" and op == "<=" and meets) or (kind == "at_least" and op == "<="
                                                                             and not meets):
        return meets
    return None


def summarize(runs: dict[str, list[dict[str, Any]]], rate: float | None) -> dict[str, Any]:
    """Per configuration the spread over seeds; the issue's ratios paired by seed and judged.

    Sets each run's ``target_loss`` (its seed's DDP final loss) and ``time_to_target_s``.

    Args:
        runs: the rate's runs by configuration.
        rate: the rate, Mbit/s (a target set at another rate is shown, not judged).
    """
    ok = {n: {r["seed"]: r for r in rs if "error" not in r} for n, rs in runs.items()}
    ddp = ok.get("ddp", {})
    for by_seed in ok.values():
        for seed, r in by_seed.items():
            r["target_loss"] = ddp[seed]["final_loss"] if seed in ddp else None
            r["time_to_target_s"] = time_to(r["curve"], r["target_loss"])
    out: dict[str, Any] = {"configs": {}, "ratios": {}}
    for name, by_seed in ok.items():
        rs = list(by_seed.values())
        out["configs"][name] = {k: summary([r.get(k) for r in rs]) for k in (
            "final_loss", "equal_samples_loss", "time_to_target_s", "train_s", "samples_per_s", "bytes_per_sample",
            "samples")}
        for host in ("w0", "w1"):
            out["configs"][name][f"{host}_bytes_per_sample"] = summary([r["hosts"][host]["bytes_per_sample"]
                                                                        for r in rs])
        out["configs"][name]["reached"] = sum(r["time_to_target_s"] is not None for r in rs)
        out["configs"][name]["runs"] = len(rs)
    for key, (num, den, figure) in RATIOS.items():
        seeds = sorted(set(ok.get(num, {})) & set(ok.get(den, {})))
        if not seeds:
            continue
        _, op, target, only_at = TARGETS[key]
        pairs = [pair_ratio(ok[num][s], ok[den][s], figure) for s in seeds]
        verdicts = [_verdict(v, kind, op, target) for v, kind in pairs]
        entry = {**summary([v for v, _ in pairs]), "kinds": [k for _, k in pairs], "seeds": seeds,
                 "met_seeds": sum(v is True for v in verdicts), "target": f"{op} {target:g}"}
        if only_at is None or rate == only_at:
            entry["met"] = entry["met_seeds"] > len(seeds) / 2
        out["ratios"][key] = entry
    return out


def straggler(results: dict[str, Any]) -> str:
    """How the results' slowed host was slowed: proportionally (``slow_factor`` in its specs), or by the fixed sleep
    of results written before (``slow_sleep_s``)."""
    size, step_ms = results["size"], results["step_s"] * 1e3
    if "slow_sleep_s" in results:
        return (f"`w1 slowed`: host w1 sleeps {results['slow_sleep_s'] * 1e3:.1f} ms after each step, "
                f"{size['slow_factor']:g} - 1 times the {step_ms:.1f} ms of one step measured alone on one thread.")
    return (f"`w1 slowed`: after each step host w1 sleeps {size['slow_factor']:g} - 1 times the median of its last 31 "
            f"steps, so it stays {size['slow_factor']:g} x slower than itself whatever the machine's load (one step "
            f"measured alone on one thread: {step_ms:.1f} ms; each run's median step per host: `step_median_s` in "
            "results.json).")


def _header(results: dict[str, Any]) -> list[str]:
    m, size, model = results["machine"], results["size"], results["model"]
    h = size["inner_steps"]
    params = f" ({results['parameters']:,} parameters)" if "parameters" in results else ""
    async_samples = ("its final loss is at the samples of `diloco, w1 slowed`'s." if size.get("async_until", "steps") ==
                "steps" else f"beside the slowed host, its other host trains {size['slow_factor']:g}x the steps "
                "(`--async-until together`), so both end about together; its final loss is at its own samples.")
    return [
        "# DiLoCo over slow links: the language model against DDP and hivemind", "",
        f"`{results['command']}`: {m['date']}, commit {m.get('commit')}, {m['cpu_count']} CPUs ({m['cpu_model']}), "
        f"torch {m['torch']}; {results.get('wall_s', '?')} s.", "",
        "2 worker hosts, one process each, and the PS on a third (network namespaces, each link capped both ways "
        f"by htb). ByteGPT of the language-model recipe{params}, d_model {model['d_model']}, {model['layers']} blocks, "
        f"{model['heads']} heads, windows of {model['max_context']} bytes of Debian's fortunes, AdamW at the "
        f"recipe's rate (warmup {model['warmup_steps']} steps, then constant), batch {results['batch_size']} per "
        f"worker. DDP trains {size['steps']} steps per rank ({2 * size['steps'] * results['batch_size']:,} "
        f"samples); the others {results['overtrained_steps']} per worker, so that a time to DDP's loss can be read "
        f"past DDP's samples. diloco: H = {h} inner steps, Nesterov outer optimizer (lr 0.7, momentum 0.9), pushes "
        f"coded `{size.get('compressor', 'none')}`, replies "
        + (f"differences coded `{size['downlink_codec']}` (--downlink-codec)" if size.get("downlink_codec")
           else "the model in float32") + "; "
        "async_diloco: the same H for a fast worker, dynamic local steps, "
        "the delayed Nesterov update (`outer SGD lr 1.0`: the outer step `{\"name\": \"sgd\", \"lr\": 1.0, "
        "\"momentum\": 0}` instead; `delayed Nesterov momentum 0.5` or `0.7`: the delayed Nesterov at lr 0.7 and that "
        "momentum). "
        + straggler(results) + " hivemind 1.1.12: `hivemind.Optimizer(use_local_updates=True, matchmaking_time="
        f"{size.get('hivemind_matchmaking_time', 3.0):g}, averaging_timeout=10, target_batch_size="
        f"{2 * h * results['batch_size']})`, its quickstart's parameter averaging (AdamW inside, as above), "
        f"target_batch_size set to DiLoCo's round (2 workers x H = {h} x {results['batch_size']} samples), so both "
        "average as often; a peer stops at its last step or when the other has stopped.", "",
        f"Validation loss: nats per byte on {size['val_windows']} held-out windows; of DDP's rank 0 and hivemind's "
        f"peer 0 every {size['snapshot_s']:g} s, of the PS's central model at each of its versions (pulled on the PS "
        "host's loopback). Time: wall clock from rank 0's start of training. Target loss: each seed's DDP final "
        "loss. kB/sample: both worker hosts' interface counters (tx + rx) over the launch, over the samples they "
        "trained; w0, w1: each host's over its own samples. async_diloco has no loss at DDP's samples (its rounds' "
        f"lengths vary); {async_samples} The hivemind ratio compares diloco without a slowed host. Median [min .. max] "
        "over seeds.", ""]


def markdown(results: dict[str, Any]) -> str:
    """results.md: the method, then per rate a table of every configuration and the issue's ratios against their
    targets.

    Args:
        results: the benchmark's results (``results.json``'s contents).
    """
    lines = _header(results)
    for key, entry in results["rates"].items():
        p = entry.get("probe") or {}
        lines += [f"## {key} Mbit/s (htb); a TCP transfer w0 -> ps measured {p.get('mbit_per_s', 0):.1f} Mbit/s", "",
                  "| configuration | final loss | loss at DDP's samples | time to DDP's loss (s) | reached | "
                  "run (s) | samples/s | kB/sample | w0 / w1 kB/sample |", "|---|---|---|---|---|---|---|---|---|"]
        s = entry.get("summary", {"configs": {}, "ratios": {}})
        for name, runs in entry["runs"].items():
            c = s["configs"].get(name)
            failed = [r for r in runs if "error" in r]
            if c is None or not c["runs"]:
                lines.append(f"| {LABELS[name]} | error: {failed[0]['error'] if failed else '?'} | | | | | | | |")
                continue
            lines.append(f"| {LABELS[name]} | {spread(c['final_loss'], '.4f')} "
                         f"| {spread(c['equal_samples_loss'], '.4f')} | {spread(c['time_to_target_s'], '.1f')} "
                         f"| {c['reached']}/{c['runs']} | {spread(c['train_s'], '.1f')} "
                         f"| {spread(c['samples_per_s'], ',.0f')} | {spread(c['bytes_per_sample'], '.2f', 1e3)} "
                         f"| {spread(c['w0_bytes_per_sample'], '.2f', 1e3)} / "
                         f"{spread(c['w1_bytes_per_sample'], '.2f', 1e3)} |"
                         + (f" ({len(failed)} failed)" if failed else ""))
        hive = [r for r in entry["runs"].get("hivemind", []) if "error" not in r and r.get("hivemind")]
        if hive:
            said = [r["hivemind"].get("log", {}) for r in hive]
            lines += ["", "hivemind's logs, per seed and peer: epochs " + "; ".join(
                f"{x.get('epochs')}" for x in said) + "; failed averaging rounds " + "; ".join(
                f"{x.get('averaging_failed')}" for x in said) + "; steps " + "; ".join(str(r["steps"]) for r in hive)
                + " (a peer stops when the other has)."]
        lines.append("")
        for ratio_key, r in s["ratios"].items():
            what, _, _, only_at = TARGETS[ratio_key]
            bounds = [k for k in r["kinds"] if k not in ("exact", None)]
            verdict = ("target met" if r["met"] else "target missed") if "met" in r else (
                f"target set at {only_at:g} Mbit/s only")
            lines.append(f"- {what}: **{spread(r, '.3g')}** (target {r['target']}; met in {r['met_seeds']} of "
                         f"{len(r['seeds'])} seeds: {verdict})"
                         + (f"; bounds, a run that never reached the loss: {', '.join(bounds)}" if bounds else ""))
        lines += ["", f"![loss against time and bytes at {key} Mbit/s](loss_{key}mbit.png)", ""]
    return "\n".join(lines)


def figure(results: dict[str, Any], out: Path) -> list[str]:
    """One PNG per rate: validation loss against wall time and against the worker links' bytes, a line per run.

    Args:
        results: the benchmark's results.
        out: the folder the PNGs are written to.

    Returns:
        The files' names; none without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []
    for key, entry in results["rates"].items():
        fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
        for name, runs in entry["runs"].items():
            for i, r in enumerate(x for x in runs if "error" not in x):
                label = LABELS[name] if i == 0 else None
                rows = r["curve"]
                by_time.plot([row[0] for row in rows], [row[1] for row in rows], color=COLORS[name], alpha=0.8,
                             label=label, lw=1.2)
                by_bytes.plot([max(row[2], 1) / 1e6 for row in rows], [row[1] for row in rows], color=COLORS[name],
                              alpha=0.8, label=label, lw=1.2)
        target = entry.get("summary", {}).get("configs", {}).get("ddp", {}).get("final_loss", {}).get("median")
        lowest = min((row[1] for rs in entry["runs"].values() for r in rs if "error" not in r for row in r["curve"]),
                     default=0.0)
        for ax in (by_time, by_bytes):
            if target is not None:
                ax.axhline(target, color="grey", ls="--", lw=0.8, label="DDP's final loss (median)")
            # up to a little above an untrained model's ln 256 = 5.55: a spike above it is cut off, not rescaled to
            ax.set_ylim(lowest - 0.05, 5.8)
            ax.set_ylabel("validation loss (nats/byte, cut at 5.8)")
            ax.grid(alpha=0.3)
        by_time.set_xlabel("wall time (s)")
        by_bytes.set_xlabel("bytes on the 2 worker links, tx + rx (MB)")
        by_bytes.set_xscale("log")
        by_time.legend(fontsize=8)
        fig.suptitle(f"ByteGPT on fortunes, 2 hosts at {key} Mbit/s")
        fig.tight_layout()
        name = f"loss_{key}mbit.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def write_report(results: dict[str, Any], out: Path) -> None:
    """Summarize every rate, then write results.json, results.md and the figure into ``out``.

    Args:
        results: the benchmark's results, each rate's ``summary`` set here.
        out: the results' folder.
    """
    for entry in results["rates"].values():
        entry["summary"] = summarize(entry["runs"], entry.get("rate_mbit"))
    write_json(out / "results.json", json.loads(json.dumps(results, default=str)))
    (out / "results.md").write_text(markdown(results))
    figure(results, out)
