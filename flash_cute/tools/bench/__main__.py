"""`python -m flash_cute.tools.bench`: the standalone entry point (`cli.main`), the same
options as `python -m flash_cute bench`."""

import sys

from flash_cute.tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
