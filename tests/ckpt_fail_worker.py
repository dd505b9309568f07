"""Training process for the failed-save tests (tests/test_checkpoint_damage.py).

    python tests/ckpt_fail_worker.py DIRECTORY MODE      MODE: sync | async_wait | async_next

Trains the demo's CNN (stage 2, 8 simulated devices, adam + EMA), saves step 2 and waits for
it, writes the gathered step-2 state to DIRECTORY.npz (the expected numbers), then lowers its
file-size limit (RLIMIT_FSIZE, as ``ulimit -f`` does) below the size of one array file and
saves step 4: every write past the limit fails with EFBIG (Python ignores SIGXFSZ). MODE
decides where the error must surface: ``sync`` the save itself; ``async_wait``
``checkpoint.wait``; ``async_next`` the next save (step 6). Prints ``RAISED <type>:
<message>`` for the error that reached it, or ``NO_ERROR``.
"""

import os
import resource
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jaxzero.simulate import simulate_cpu_devices  # noqa: E402  (no jax backend yet)

simulate_cpu_devices()  # 8 simulated CPU devices unless XLA_FLAGS names a count

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_problem import digits_problem, host  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import checkpoint  # noqa: E402

LIMIT = 100_000  # bytes; the state's largest array file is ~1 MB


def main() -> int:
    directory, mode = sys.argv[1], sys.argv[2]
    params, loss_fn, batches = digits_problem(steps=6)
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.99))
    state = step.init(params)
    mngr = checkpoint.manager(directory, async_save=mode != "sync")
    try:
        for i, batch in enumerate(batches, 1):
            state, _ = step(state, batch)
            if i == 2:
                checkpoint.save(mngr, i, state, zero=zero, wait=True)
                np.savez(directory + ".npz", **host(state))
                resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))
            elif i in (4, 6):
                checkpoint.save(mngr, i, state, zero=zero)
                print(f"SAVE_RETURNED {i}", flush=True)
                if mode == "async_wait":
                    checkpoint.wait(mngr)
        checkpoint.wait(mngr)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
        return 0
    print("NO_ERROR", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
