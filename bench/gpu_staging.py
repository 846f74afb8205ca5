"""The recipe CNN's tensors between a CUDA device and numpy: a ``.cpu()`` per tensor against plug_asgd.worker.staging.

    PYTHONPATH=. python -m bench.gpu_staging [repeats]

Times, per model's worth (the push's direction, then the reply's): today's per-tensor copies
(``tensors.to_numpy``: a synchronous ``.cpu()`` into fresh pageable memory; ``tensors.assign``:
a pageable tensor copied synchronously) and :class:`plug_asgd.worker.staging.Staging` (pinned buffers
kept, non-blocking copies, one wait per push). Checks that both give the same bits. Needs a CUDA
GPU: without one it says so and exits with status 0 (nothing is measured).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # the first call allocates (the staging's buffers, the caching allocators)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()  # a load's copies are not waited for by the call itself
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(repeats: int) -> None:
    from plug_asgd.recipes.mnist import MnistCNN
    from plug_asgd.worker.staging import Staging
    from plug_asgd.worker.tensors import assign, to_numpy

    model = MnistCNN().cuda()
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if b.is_floating_point())
    staging = Staging()
    plain_out = {n: to_numpy(t) for n, t in tensors.items()}
    staged_out = staging.to_host(tensors)
    assert all(plain_out[n].tobytes() == staged_out[n].tobytes() for n in tensors), "push arrays differ"
    reply = {n: a.copy() for n, a in plain_out.items()}
    nbytes = sum(a.nbytes for a in reply.values())

    def per_tensor_load() -> None:
        for n, t in tensors.items():
            assign(t, reply[n])

    rows = [("push: .cpu() per tensor", _median_ms(lambda: {n: to_numpy(t) for n, t in tensors.items()}, repeats)),
            ("push: Staging.to_host", _median_ms(lambda: staging.to_host(tensors), repeats)),
            ("reply: assign per tensor", _median_ms(per_tensor_load, repeats)),
            ("reply: Staging.load", _median_ms(lambda: staging.load(tensors, reply), repeats))]
    for n, t in tensors.items():
        assert t.detach().cpu().numpy().tobytes() == reply[n].tobytes(), "loaded values differ"
    print(f"{torch.cuda.get_device_name(0)}, {len(tensors)} tensors, {nbytes / 1e6:.1f} MB, "
          f"median of {repeats}:")
    for label, ms in rows:
        print(f"  {label:28s} {ms:8.3f} ms")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("bench.gpu_staging needs a CUDA GPU: none here, nothing measured")
        sys.exit(0)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
