"""``python -m harness.conformance``: see ``harness.conformance.cli``."""

import sys

from harness.conformance.cli import main

sys.exit(main())
