"""`python -m memspec.cli` (the tests start the daemon this way)."""

import sys

from memspec.cli.main import main

sys.exit(main())
