"""The staleness remedies compared in one process: N simulated workers, the real fold rules and codecs.

    PYTHONPATH=. python -m bench.momentum_sim --kind fashion --mode adacomp --treat la+scale+localres+mask
    PYTHONPATH=. python -m bench.momentum_sim --kind regression --mode asgd --treat none --workers 4

How ``docs/momentum.md`` chose among the remedies: workers take turns (each pushes once per
round, in a shuffled order with ``--order shuffled``), so each update is ``workers - 1`` versions
stale, as between racing processes, and a candidate costs seconds instead of a launch. ``--treat``
joins any of: ``scale`` (update times 1/workers), ``la`` (look-ahead by workers - 1 versions),
``localres`` (the codec's residual kept in the worker's model), ``mask`` (momentum zeroed where a
sparse update was sent), ``mcomp`` (the momentum of each worker lowered to ``1 - N (1 - mu)``,
so that with the implicit momentum of asynchrony the total is the optimizer's), ``lrscale`` (each
worker's learning rate divided by the workers, its update pushed whole: hogwild's scaled step),
``flush`` (at the end, each worker's pending residual pushed whole), ``flushavg`` (the same at ``1/workers``: the
mean of the workers' models where they pulled the same central one); or ``none``.
``--mode downpour:push_every=2`` sets a mode's integer knobs.
``--mode ddp`` and ``--mode single`` are the references. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from plug_asgd import compressors, modes
from plug_asgd.compressors import TopKResidual, decode
from plug_asgd.modes import CentralState, Push
from plug_asgd.protocol.wire import Sparse
from plug_asgd.recipes.idx import load_mnist
from plug_asgd.recipes.mnist import MnistCNN, normalize
from plug_asgd.worker.compensation import MOMENTUM_STATE_KEYS

TREATMENTS = ("scale", "la", "localres", "mask", "mcomp", "lrscale", "flush", "flushavg")


def data(kind: str, n_train: int, n_val: int = 2000) -> tuple[torch.Tensor, ...]:
    if kind == "fashion":
        tx, ty, vx, vy = load_mnist("/usr/share/datasets/fashion-mnist", download=False)
        idx = np.random.default_rng([0, 0]).permutation(len(tx))[:n_train]
        vidx = np.random.default_rng([0, 1]).permutation(len(vx))[:n_val]
        labels = torch.as_tensor(ty[idx]).long(), torch.as_tensor(vy[vidx]).long()
        return normalize(tx[idx]), labels[0], normalize(vx[vidx]), labels[1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_train + 1000, 8, generator=g)
    w1, w2 = torch.randn(8, 16, generator=g), torch.randn(16, 1, generator=g) * 1.6
    y = torch.tanh(x @ w1) @ w2 + 0.9 * x[:, :1] + 0.1 * torch.randn(n_train + 1000, 1, generator=g)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def make_model(kind: str) -> nn.Module:
    return MnistCNN().net if kind == "fashion" else nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def make_opt(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=name == "nesterov")


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y) if kind == "fashion" else nn.functional.mse_loss(out, y)


def evaluate(kind: str, model: nn.Module, vx: torch.Tensor, vy: torch.Tensor) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        out = model(vx)
        result = {"loss": loss_of(kind, out, vy).item()}
        if kind == "fashion":
            result["acc"] = (out.argmax(1) == vy).float().mean().item()
    model.train()
    return result


def reference(args: argparse.Namespace, model: nn.Module, tx: torch.Tensor, ty: torch.Tensor) -> nn.Module:
    """One process at the per-worker batch (``single``) or at workers x batch (``ddp``: averaged gradients)."""
    opt = make_opt(args.opt, model.parameters(), args.lr)
    batch = args.batch * (args.workers if args.mode == "ddp" else 1)
    for _ in range(args.epochs):
        perm = torch.randperm(len(tx))
        for i in range(0, len(tx) - batch + 1, batch):
            b = perm[i:i + batch]
            opt.zero_grad()
            loss_of(args.kind, model(tx[b]), ty[b]).backward()
            opt.step()
    return model


def lower_momentum(opt: torch.optim.Optimizer, workers: int) -> None:
    """``mcomp``: scale the momentum buffers so that each worker's momentum is ``1 - N (1 - mu)``."""
    for group in opt.param_groups:
        mu = group.get("momentum") or (group["betas"][0] if "betas" in group else 0.0)
        if mu:
            factor = max(0.0, 1.0 - workers * (1.0 - mu)) / mu
            for p in group["params"]:
                for key in MOMENTUM_STATE_KEYS:
                    if isinstance(opt.state.get(p, {}).get(key), torch.Tensor):
                        opt.state[p][key].mul_(factor)


def mode_spec(text: str) -> str | dict[str, Any]:
    """``downpour`` or ``downpour:push_every=2,pull_every=2``: a mode's name, with integer knobs after a colon."""
    name, _, knobs = text.partition(":")
    return {"name": name, **{k: int(v) for k, v in (kv.split("=") for kv in knobs.split(","))}} if knobs else name


def simulate(args: argparse.Namespace, model: nn.Module, tx: torch.Tensor, ty: torch.Tensor) -> nn.Module | None:
    treat = set(args.treat.split("+")) - {"none"}
    n, spec = args.workers, modes.get(mode_spec(args.mode)).for_workers(args.workers)
    rule = spec.make_rule({})
    rule.training_ranks = frozenset(range(n))
    state = CentralState({k: p.detach().numpy().copy() for k, p in model.named_parameters()})
    push_every = getattr(spec, "push_every", 1)
    workers = []
    for k in range(n):
        m = copy.deepcopy(model)
        knobs = {"fraction": args.fraction} if args.codec in ("topk", "randomk") else {}
        codec = TopKResidual(args.fraction) if args.mode == "adacomp" else compressors.get(
            {"name": args.codec, **knobs}).encoder(k)
        lr = args.lr / (n if "lrscale" in treat else 1)
        workers.append({"m": m, "opt": make_opt(args.opt, m.parameters(), lr), "codec": codec, "version": 0,
                        "since": 0, "base": {a: p.detach().clone() for a, p in m.named_parameters()},
                        "prev": {a: p.detach().clone() for a, p in m.named_parameters()}})
    rng = np.random.default_rng(args.seed)
    steps = (len(tx) // n) // args.batch
    for _ in range(args.epochs):
        perms = [torch.randperm(len(tx))[k::n] for k in range(n)]
        for s in range(steps):
            for k in (rng.permutation(n) if args.order == "shuffled" else range(n)):
                w = workers[k]
                m, opt = w["m"], w["opt"]
                b = perms[k][s * args.batch:(s + 1) * args.batch]
                opt.zero_grad()
                loss_of(args.kind, m(tx[b]), ty[b]).backward()
                opt.step()
                if "mcomp" in treat:
                    lower_momentum(opt, n)
                w["since"] += 1
                if w["since"] < push_every:
                    continue
                scale = (1.0 / n if "scale" in treat else 1.0) / (w["since"] if spec.normalize else 1)
                w["since"] = 0
                update = {}
                for name, p in m.named_parameters():
                    d = (p.detach() - w["base"][name]).numpy() * scale
                    sent = w["codec"].encode(name, d)
                    update[name] = sent if isinstance(sent, (np.ndarray, Sparse)) else decode(sent, np.float32,
                                                                                                shape=d.shape)
                    if "mask" in treat and isinstance(sent, Sparse):
                        for key in MOMENTUM_STATE_KEYS:
                            if isinstance(opt.state.get(p, {}).get(key), torch.Tensor):
                                opt.state[p][key].view(-1)[torch.from_numpy(sent.indices)] = 0
                rule.push(state, Push(token=k, rank=k, base_version=w["version"], update=update))
                if not all(np.isfinite(t).all() for t in state.tensors.values()):
                    return None
                versions = max(1, state.version - w["version"])
                with torch.no_grad():
                    for name, p in m.named_parameters():
                        c = torch.from_numpy(state.tensors[name]).clone()
                        p.copy_(c)
                        if "la" in treat and push_every == 1:
                            p.add_((c - w["prev"][name]) / versions, alpha=n - 1)
                        w["prev"][name].copy_(c)
                        pending = getattr(w["codec"], "pending", lambda _: None)(name)
                        if "localres" in treat and pending is not None:
                            p.add_(torch.from_numpy(np.asarray(pending)).view_as(p))
                        w["base"][name].copy_(p)
                w["version"] = state.version
    if treat & {"flush", "flushavg"}:  # each worker's pending residual pushed (whole, or at 1/n), as it leaves
        wt = 1.0 / n if "flushavg" in treat else 1.0
        for k, w in enumerate(workers):
            pending = getattr(w["codec"], "pending", lambda _: None)
            update = {name: wt * np.asarray(pending(name)).reshape(p.shape).astype(np.float32)
                      for name, p in w["m"].named_parameters() if pending(name) is not None}
            if update:
                rule.push(state, Push(token=k, rank=k, base_version=w["version"], update=update))
    central = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in central.named_parameters():
            p.copy_(torch.from_numpy(state.tensors[name]))
    return central


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.momentum_sim", description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("fashion", "regression"), default="regression")
    ap.add_argument("--mode", default="asgd", help="a mode with a fold rule (knobs after a colon: "
                    "downpour:push_every=2), or ddp / single (the references)")
    ap.add_argument("--opt", choices=("sgd", "nesterov", "adam"), default="sgd")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=None, help="default: 1 (fashion), 3 (regression)")
    ap.add_argument("--n-train", type=int, default=None, help="default: 20,000 (fashion), 4,096 (regression)")
    ap.add_argument("--treat", default="none", help="'none' or a '+' of " + ", ".join(TREATMENTS))
    ap.add_argument("--codec", default="none", help="asgd's compressor (adacomp has its own)")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--order", choices=("turns", "shuffled"), default="turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-val", type=int, default=2000, help="test images (fashion; 10,000: the whole test set)")
    args = ap.parse_args(argv)
    unknown = set(args.treat.split("+")) - {"none", *TREATMENTS}
    if unknown:
        ap.error(f"unknown treatment(s) {sorted(unknown)}: choose from {', '.join(TREATMENTS)}")
    fashion = args.kind == "fashion"
    args.epochs = args.epochs or (1 if fashion else 3)
    args.n_train = args.n_train or (20000 if fashion else 4096)
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    tx, ty, vx, vy = data(args.kind, args.n_train, args.n_val)
    model = make_model(args.kind)
    before = evaluate(args.kind, model, vx, vy)
    t = time.monotonic()
    final = reference(args, model, tx, ty) if args.mode in ("ddp", "single") else simulate(args, model, tx, ty)
    after = evaluate(args.kind, final, vx, vy) if final is not None else {"loss": float("inf"), "diverged": True}
    print(json.dumps({k: getattr(args, k) for k in ("kind", "mode", "codec", "opt", "lr", "workers", "treat")}
                     | {"before": before, "after": after, "s": round(time.monotonic() - t, 1)}))


if __name__ == "__main__":
    main()
