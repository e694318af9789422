"""The README's main job on the embedded defaults.

Until ``cspan infer`` lands this lists the installed verbs (``cspan --help``).
"""

from __future__ import annotations

import subprocess
import sys

if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "cspan.core.cli", "--help"]))
