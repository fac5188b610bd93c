"""`python -m cachefuse.cli ...`: the same as the `cachefuse` console script."""

import sys

from cachefuse.cli.main import main

sys.exit(main())
