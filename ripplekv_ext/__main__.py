"""`python -m ripplekv_ext ...` is the `ripplekv` command."""

import sys

from ripplekv_ext.cli import main

if __name__ == "__main__":
    sys.exit(main())
