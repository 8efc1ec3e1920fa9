"""``python -m harness.conformance``: see ``harness.conformance.cli``."""

import sys

from harness.cli.parsing import interrupts_raise
from harness.conformance.cli import main

interrupts_raise()  # Ctrl-C exited at once while importing (harness/__init__); now main's
sys.exit(main())
