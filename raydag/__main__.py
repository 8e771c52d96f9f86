"""``python -m raydag report RUN_DIR -o report.html``: the same as the ``raydag`` command."""

import sys

from raydag.cli import main

sys.exit(main())
