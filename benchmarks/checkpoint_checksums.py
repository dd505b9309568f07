"""The cost of checkpoint checksums: save and restore time with and without them.

    python benchmarks/checkpoint_checksums.py [--repeats 7] [--model digits|transformer|both]

For the demo's model (examples/digits.py's CNN, 151K params) and tests/models.py's
transformer, at stage 2 on 8 simulated devices with adam + EMA, each repetition times a
synchronous save (``wait=True``, a fresh step directory) and a restore of that step, once as
shipped and once with the checksums switched off (the hash replaced by nothing, the check by
a no-op), alternating. Prints the median (and minimum) milliseconds, and the time spent in the
checksum work itself inside each save and restore (timed in place: on a loaded machine the
totals vary by more than the checksums cost).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jaxzero.simulate import simulate_cpu_devices  # noqa: E402  (no jax backend yet)

simulate_cpu_devices()  # 8 simulated CPU devices unless XLA_FLAGS names a count

import argparse  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import jaxzero as jz  # noqa: E402
from jaxzero import checkpoint as ck  # noqa: E402
from jaxzero.checkpoint import integrity, io  # noqa: E402


def problem(name):
    if name == "digits":
        from digits_problem import digits_problem

        return digits_problem(steps=1)
    from models import make_problem

    return make_problem("transformer", steps=1)


SPENT = {"save": [], "restore": []}


def _timed(fn, key):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        SPENT[key].append((time.perf_counter() - t0) * 1e3)
        return out

    return wrapper


io._checksums = _timed(io._checksums, "save")  # the checksum work inside save / restore
integrity.check = _timed(integrity.check, "restore")


@contextlib.contextmanager
def checksums_off():
    saved = io._checksums, integrity.check
    io._checksums = lambda state, extra: None
    integrity.check = lambda *a, **k: 0
    try:
        yield
    finally:
        io._checksums, integrity.check = saved


def one(root, i, zero, params, state, ema):
    directory = os.path.join(root, f"run{i}")
    t0 = time.perf_counter()
    ck.save(directory, 1, state, zero=zero, wait=True)
    t1 = time.perf_counter()
    jax.block_until_ready(ck.restore(directory, zero, params, ema=ema))
    t2 = time.perf_counter()
    shutil.rmtree(directory)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def measure(name, repeats):
    params, loss_fn, batches = problem(name)
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2)
    ema = jz.ShardedEMA(0.99)
    step = jz.make_train_step(loss_fn, zero, ema=ema)
    state, _ = step(step.init(params), batches[0])
    jax.block_until_ready(state)
    n = sum(x.size for x in jax.tree.leaves(params))
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    times = {"on": [], "off": []}
    for v in SPENT.values():
        v.clear()
    with tempfile.TemporaryDirectory() as root:
        one(root, -1, zero, params, state, ema)  # warm-up (compiles the restore placement)
        for i in range(repeats):
            times["on"].append(one(root, 2 * i, zero, params, state, ema))
            with checksums_off():
                times["off"].append(one(root, 2 * i + 1, zero, params, state, ema))

    def cell(key, j):
        xs = [r[j] for r in times[key]]
        return f"{statistics.median(xs):7.1f} (min {min(xs):6.1f})"

    print(
        f"{name}: {n} params, state {total / 2**20:.2f} MiB in {len(jax.tree.leaves(state))} leaves; "
        f"median (min) of {repeats}, ms:"
    )
    print(f"  save:    with checksums {cell('on', 0)}   without {cell('off', 0)}")
    print(f"  restore: with checksums {cell('on', 1)}   without {cell('off', 1)}")
    for key in ("save", "restore"):
        xs = SPENT[key][1:]  # without the warm-up
        print(
            f"  checksum work inside {key}: median {statistics.median(xs):.1f} ms "
            f"(min {min(xs):.1f}, max {max(xs):.1f})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", choices=["digits", "transformer", "both"], default="both")
    args = parser.parse_args()
    for name in ("digits", "transformer") if args.model == "both" else (args.model,):
        measure(name, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
