"""``python -m jaxzero.launch``: start a multi-process jax program on this machine.

The command line is :mod:`jaxzero.cli.launch` (``python -m jaxzero.launch --help``); the
library side (``launch``, ``process_env``, ``free_port``) is :mod:`jaxzero.distributed.launch`.
Both are re-exported here, where users have always found them.
"""

import sys

from jaxzero.cli.launch import main as main
from jaxzero.cli.launch import parse_args as parse_args
from jaxzero.distributed.launch import free_port as free_port
from jaxzero.distributed.launch import launch as launch
from jaxzero.distributed.launch import process_env as process_env
from jaxzero.simulate import DEVICE_COUNT_FLAG as DEVICE_COUNT_FLAG

if __name__ == "__main__":
    sys.exit(main())
