"""``python main.py VERB ...`` works like ``cspan VERB ...`` (the upstream system is used this way)."""

import sys

from cspan.core.cli import main

if __name__ == "__main__":
    sys.exit(main())
