"""``python -m harness.conformance``: see ``harness.conformance.cli``."""

import sys

from harness.conformance.cli import main
from harness.parsing import interrupts_raise

interrupts_raise()  # Ctrl-C exited at once while importing (harness/__init__); now main's
sys.exit(main())
