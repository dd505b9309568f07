"""`make demo`: the main example (digits with ZeRO + sharded EMA) when present, otherwise
a short ZeRO-2 training of a small Flax model printing the loss per step."""

import os
import runpy
import sys

here = os.path.dirname(os.path.abspath(__file__))
digits = os.path.join(here, "digits.py")
if os.path.exists(digits):
    sys.argv = [digits, *sys.argv[1:]]
    runpy.run_path(digits, run_name="__main__")
else:
    os.environ.setdefault("QUICKSTART_STEPS", "30")
    runpy.run_path(os.path.join(here, "quickstart.py"), run_name="__main__")
