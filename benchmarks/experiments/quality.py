"""Quality/speed sweep of the bundled demo model: the same as `fastcar-compile eval` (see docs/demo.md).

    python benchmarks/experiments/quality.py [--clips 8] [--out fastcar-out/eval]
"""

from __future__ import annotations

import sys

from fastcar_compile.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
