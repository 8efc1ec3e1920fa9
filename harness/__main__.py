"""``python -m harness``: the equivalence harness (see ``harness.cli.main``)."""

import sys

from harness.cli.main import main

sys.exit(main())
