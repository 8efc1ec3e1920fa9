"""``python -m harness``: the equivalence harness (see ``harness.cli.main``).

Ctrl-C while torch and transformers import is one line and exit 130 (``harness/__init__``
set that up); ``main`` takes over from there.
"""

import sys

from harness.cli.main import main

sys.exit(main())
