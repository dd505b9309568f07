"""Sharded checkpoints of the ZeRO training state: a thin adapter over Orbax.

Everything is delegated to :class:`orbax.checkpoint.CheckpointManager`; this module only
configures it for jaxzero and adds the jaxzero-specific parts:

* :func:`manager` builds a manager with three items per step: ``"state"`` (the
  :class:`~jaxzero.TrainState`, ``StandardSave``/``StandardRestore``: every process writes
  only its own shards, nothing is gathered), ``"metadata"`` (``JsonSave``: jaxzero version,
  stage, mesh, precision, optimizer, and every leaf's path/shape/dtype/bytes) and the optional
  ``"extra"`` (a small user pytree such as a data-loader position).
* :func:`save` writes one step (asynchronously by default).
* :func:`restore` checks the stored tree against the target (paths, shapes, dtypes) and then
  lets Orbax read every array straight into the target's shardings, so a checkpoint written
  on N devices at one stage restores on any N / stage / mesh (``ZeRO.abstract_state``
  supplies the shardings).
* :func:`export` writes a gathered, unsharded tree (EMA, params or master) for inference;
  with ``opt_state=True`` the optax state and step beside the master, as a Flax
  ``TrainState`` holds them (:func:`load_export` reads either back).
* :func:`adopt` continues a plain Flax/optax run (a Flax ``TrainState``, or a plain orbax
  checkpoint of its params, optax state and step) as a jaxzero ``TrainState``.
* :func:`inspect` renders a checkpoint directory as text (for ``jaxzero inspect``).

Every array's checksum is saved in the step's metadata and checked when it is read back
(:mod:`jaxzero.checkpoint.integrity`): a damaged step fails to restore with
:class:`CheckpointDamagedError` naming the step, the damaged file and the leaf (``restore(..., fallback=True)``
takes the newest step that verifies instead), and :func:`verify` reads every step and reports
the damaged ones. A failed write (disk full) raises OSError from ``save`` (or, for an
asynchronous save, from the next ``save`` or :func:`wait`).

A save is atomic: Orbax writes into a temporary directory and renames it when every item is
committed, so a process killed mid-save leaves only a ``<step>.orbax-checkpoint-tmp-*``
directory that :func:`restore` never considers (and that :func:`manager` removes).

Example::

    mngr = jz.checkpoint.manager("/ckpt", max_to_keep=3)
    for i, batch in enumerate(batches, 1):
        state, _ = step(state, batch)
        jz.checkpoint.save(mngr, i, state, zero=zero, extra={"loader": np.int64(i)})
    mngr.wait_until_finished()
    ...
    state = jz.checkpoint.restore("/ckpt", zero, params, ema=ema)   # latest complete step
"""

from jaxzero.checkpoint import io, nvme
from jaxzero.checkpoint.adopt import adopt
from jaxzero.checkpoint.export import export, load_export
from jaxzero.checkpoint.integrity import CheckpointDamagedError
from jaxzero.checkpoint.io import (
    DamagedStepWarning,
    check_compatible,
    latest_step,
    load_metadata,
    manager,
    restore,
    save,
    wait,
)
from jaxzero.checkpoint.report import StepReport, VerifyReport, inspect, verify
from jaxzero.checkpoint.structure import EXTRA as EXTRA
from jaxzero.checkpoint.structure import FORMAT as FORMAT
from jaxzero.checkpoint.structure import ITEMS as ITEMS
from jaxzero.checkpoint.structure import METADATA as METADATA
from jaxzero.checkpoint.structure import STATE as STATE
from jaxzero.checkpoint.structure import describe
from jaxzero.checkpoint.structure import leaf_table as leaf_table

# the NVMe tier's checkpoint item, save and restore (built on io, which never imports it)
io.use_disk_tier(nvme)

__all__ = [
    "adopt",
    "CheckpointDamagedError",
    "DamagedStepWarning",
    "StepReport",
    "VerifyReport",
    "check_compatible",
    "describe",
    "export",
    "inspect",
    "latest_step",
    "load_export",
    "load_metadata",
    "manager",
    "restore",
    "save",
    "verify",
    "wait",
]
