"""`python -m sgl serve ...`: the same as the `sgl` command."""

from __future__ import annotations

import sys

from sgl.cli import main

if __name__ == "__main__":
    sys.exit(main())
