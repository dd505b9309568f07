"""Training process for the checkpoint crash test (tests/test_checkpoint.py).

    python tests/ckpt_worker.py DIRECTORY [DUMMY_MB]

Trains the MLP problem (stage 2, 8 simulated devices, adam + EMA), saves step 2 and waits
for it (prints ``SAVED 2``), then starts an asynchronous save of step 4 whose ``extra`` holds
a DUMMY_MB (default 200) float32 array, so the background write is slow, and prints
``SLOW_SAVE_STARTED 4`` while it is still being written. It then sleeps: the test SIGKILLs it
mid-save. The environment (XLA_FLAGS, JAX_PLATFORMS) comes from the parent test process.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jaxzero.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices()  # 8 simulated CPU devices unless XLA_FLAGS names a count

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxzero as jz  # noqa: E402
from jaxzero import checkpoint  # noqa: E402
from jaxzero.gpu.models import make_problem  # noqa: E402


def main() -> int:
    directory = sys.argv[1]
    dummy_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    params, loss_fn, batches = make_problem("mlp", steps=4)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.99))
    state = step.init(params)
    mngr = checkpoint.manager(directory, async_save=True)
    for i, batch in enumerate(batches, 1):
        state, _ = step(state, batch)
        if i == 2:
            checkpoint.save(mngr, i, state, zero=zero, extra={"pos": np.int64(i)}, wait=True)
            print("SAVED 2", flush=True)
    # Not compressible to nothing, cheap to make: a ramp.
    dummy = np.arange(dummy_mb * 2**20 // 4, dtype=np.float32)
    started = checkpoint.save(mngr, 4, state, zero=zero, extra={"pos": np.int64(4), "dummy": dummy})
    assert started and mngr.is_saving_in_progress()
    print("SLOW_SAVE_STARTED 4", flush=True)
    time.sleep(120)  # killed here
    mngr.wait_until_finished()
    print("SLOW_SAVE_FINISHED 4", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
