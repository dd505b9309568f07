"""``python -m jaxzero.cli``: the ``jaxzero`` command line."""

import sys

from jaxzero.cli import main

sys.exit(main())
