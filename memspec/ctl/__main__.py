"""`python -m memspec.ctl`: the same as `memspec-ctl`."""

import sys

from memspec.ctl.main import main

sys.exit(main())
