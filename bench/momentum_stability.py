"""Where momentum SGD under asynchrony stops being stable: the largest stable ``lr * h`` on a quadratic.

    PYTHONPATH=. python -m bench.momentum_stability

The loss ``h w**2 / 2``, exact gradients, N workers taking turns, each with its own momentum
buffer (0.9), each update ``N - 1`` versions stale: the smallest model of what ``docs/momentum.md``
compares. A remedy that raises the bound lets a larger curvature (a sharper model, a larger
learning rate) train. One process is stable up to ``2 (1 + mu) = 3.8``. Found by bisection.

``nesterov``: each worker's heavy-ball step ``lr * m`` taken in Nesterov's form, ``lr * (g + mu * m)``
(what ``staleness.nesterov_form`` does). Hogwild is the rows of one step per push with the scale: one
shared model, each worker's gradient read ``N - 1`` of the others' steps before its own step lands,
each step scaled by ``1/N`` (its ``scale`` and ``scale+nesterov`` columns).
"""

from __future__ import annotations


def diverges(lrh: float, workers: int, mu: float = 0.9, steps_per_push: int = 1, scale: float = 1.0,
             lookahead: bool = False, worker_mu: float | None = None, nesterov: bool = False,
             rounds: int = 4000) -> bool:
    mu_w = mu if worker_mu is None else worker_mu
    w, version = 1.0, 0
    local, base, seen, seen_version = [w] * workers, [w] * workers, [w] * workers, [0] * workers
    m = [0.0] * workers
    for t in range(rounds):
        k = t % workers
        for _ in range(steps_per_push):
            m[k] = mu_w * m[k] + local[k]
            local[k] -= lrh * (local[k] + mu_w * m[k] if nesterov else m[k])
        w += scale * (local[k] - base[k])
        version += 1
        velocity = (w - seen[k]) / max(1, version - seen_version[k])
        seen[k], seen_version[k] = w, version
        local[k] = base[k] = w + (workers - 1) * velocity if lookahead else w
        if abs(w) > 1e6:
            return True
    return abs(w) > 0.5


def bound(**kw: float | int | bool | None) -> float:
    lo, hi = 1e-4, 10.0
    for _ in range(36):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if diverges(mid, **kw) else (mid, hi)
    return lo


def main() -> None:
    print(f"one process: {bound(workers=1):.3f} (heavy ball), {bound(workers=1, nesterov=True):.3f} (Nesterov)")
    print("workers  steps/push  none    scale   mcomp   la      la+mcomp  la+scale  scale+nesterov")
    for workers, steps in ((2, 1), (4, 1), (8, 1), (2, 4)):
        mcomp = max(0.0, 1 - workers * 0.1)
        row = [bound(workers=workers, steps_per_push=steps),
               bound(workers=workers, steps_per_push=steps, scale=1 / workers),
               bound(workers=workers, steps_per_push=steps, worker_mu=mcomp),
               bound(workers=workers, steps_per_push=steps, lookahead=True),
               bound(workers=workers, steps_per_push=steps, lookahead=True, worker_mu=mcomp),
               bound(workers=workers, steps_per_push=steps, lookahead=True, scale=1 / workers),
               bound(workers=workers, steps_per_push=steps, scale=1 / workers, nesterov=True)]
        print(f"{workers:7d}  {steps:10d}  " + "  ".join(f"{b:6.3f}" for b in row))
    print("hogwild: the rows of 1 step per push, columns scale (heavy ball) and scale+nesterov (Nesterov's form)")


if __name__ == "__main__":
    main()
