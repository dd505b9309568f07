"""Multi-process (multi-host / multi-controller) training helpers.

In a multi-process run every process executes the same program on its own local devices;
``jax.distributed.initialize`` connects the processes, and a ``jax.Array`` on the global mesh
holds, in each process, only the shards of that process's devices. jaxzero's step, gather and
checkpoint code run unchanged; three things differ, and this module covers them:

* **Start-up**: :func:`initialize` before any other jax call (it reads the environment set by
  ``python -m jaxzero.cli.launch``, or lets jax auto-detect SLURM / Open MPI / TPU clusters,
  and selects gloo collectives for CPU processes; a loopback coordinator binds every listener
  to that address, see :mod:`jaxzero.distributed.bind`). It returns False (and does nothing)
  when no multi-process environment is found, so the same script runs on one process too.
* **Data**: each process loads only its rows of the global batch
  (:func:`process_batch_slice`) and :func:`global_batch` assembles the global arrays from
  every process's slice without moving data between processes.
* **Reading results**: :func:`gather_to_host` returns full numpy arrays on every process.

Example::

    import jaxzero as jz
    from jaxzero import distributed as dist

    dist.initialize()                        # first jax call of the program
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(), stage=2)   # all devices of all processes
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.999))
    state = step.init(params)                # same params (same seed) on every process
    rows = dist.process_batch_slice(zero, global_batch_size)
    for batch in loader(rows):               # this process's rows only
        state, metrics = step(state, dist.global_batch(batch, zero))
    ema = dist.gather_to_host(state.ema)     # numpy, on every process
"""

from jaxzero.distributed.bind import ENV_BIND_ADDRESS as ENV_BIND_ADDRESS
from jaxzero.distributed.host import gather_to_host as gather_to_host
from jaxzero.distributed.runtime import ENV_COORDINATOR as ENV_COORDINATOR
from jaxzero.distributed.runtime import ENV_HEARTBEAT_TIMEOUT as ENV_HEARTBEAT_TIMEOUT
from jaxzero.distributed.runtime import ENV_INIT_TIMEOUT as ENV_INIT_TIMEOUT
from jaxzero.distributed.runtime import ENV_LOCAL_DEVICE_IDS as ENV_LOCAL_DEVICE_IDS
from jaxzero.distributed.runtime import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from jaxzero.distributed.runtime import ENV_PROCESS_ID as ENV_PROCESS_ID
from jaxzero.distributed.runtime import check_same_on_all_processes as check_same_on_all_processes
from jaxzero.distributed.runtime import cluster_detected as cluster_detected
from jaxzero.distributed.runtime import global_batch as global_batch
from jaxzero.distributed.runtime import initialize as initialize
from jaxzero.distributed.runtime import process_batch_slice as process_batch_slice

__all__ = [
    "ENV_BIND_ADDRESS",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "check_same_on_all_processes",
    "cluster_detected",
    "gather_to_host",
    "global_batch",
    "initialize",
    "process_batch_slice",
]
