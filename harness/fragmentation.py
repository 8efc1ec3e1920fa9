"""``python -m harness.fragmentation``: the article's command, kept under its first name.

The benchmark itself is ``harness.bench.fragmentation``; this name runs it unchanged.
"""

import sys

from harness.bench.fragmentation import main
from harness.parsing import run_interruptible

if __name__ == "__main__":
    sys.exit(run_interruptible("python -m harness.fragmentation", main))
