"""Training process for the NVMe tier's kill-and-resume test (tests/test_nvme_checkpoint.py).

    python tests/nvme_ckpt_worker.py train RUN CKPT      # NVME_CKPT_PAUSE=<marker file>
    python tests/nvme_ckpt_worker.py resume RUN CKPT OUT

``train``: test_nvme_step's MLP at stage 2 on 8 simulated devices with the optimizer state on
disk under RUN, two steps, a checkpoint of step 2 in CKPT, then step 3, whose update stops
after the first group of the file is written (``Swapper.write_back`` patched here: the write
lands, the marker file appears, the process sleeps) for the test to SIGKILL it.

``resume``: restores the newest step of CKPT into RUN, prints the warnings it gives, trains
steps 3 and 4 and writes the params and the optax state (read from the file) to OUT (``.npz``,
the leaves of ``(params, opt_state)`` in flattening order). The environment (XLA_FLAGS,
JAX_PLATFORMS) comes from the parent test process.
"""

import os
import sys
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jaxzero.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices()  # 8 simulated CPU devices unless XLA_FLAGS names a count

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_nvme_step import TX, _problem  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import checkpoint  # noqa: E402
from jaxzero.zero.offload.nvme import Swapper  # noqa: E402


def _pause_after_first_write(marker: str) -> None:
    """The next ``write_back`` lands, then the process waits to be killed."""
    write_back = Swapper.write_back

    def patched(self, g, *args, **kwargs):
        write_back(self, g, *args, **kwargs)
        self.flush()
        with open(marker, "w") as f:
            f.write(str(g))
        time.sleep(600)

    Swapper.write_back = patched


def main() -> int:
    mode, run, ckpt = sys.argv[1:4]
    params, loss_fn, batches = _problem(4)
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(8), stage=2, offload=jz.NVMe(run))
    step = jz.make_train_step(loss_fn, zero)
    if mode == "train":
        state = step.init(params)
        for b in batches[:2]:
            state, _ = step(state, b)
        checkpoint.save(ckpt, 2, state, zero=zero, wait=True)
        _pause_after_first_write(os.environ["NVME_CKPT_PAUSE"])
        step(state, batches[2])
        return 1  # not reached: killed in the update
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        state = checkpoint.restore(ckpt, zero, params)
    for w in seen:
        print(f"warning: {w.message}", flush=True)
    for b in batches[2:]:
        state, _ = step(state, b)
    opt_state, _ = state.optimizer_state()
    leaves = jax.tree.leaves((jax.tree.map(np.asarray, jz.gather(state.params)), opt_state))
    np.savez(sys.argv[4], **{f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)})
    state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
