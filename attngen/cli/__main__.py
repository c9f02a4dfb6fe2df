"""`python -m attngen.cli`: the same commands as `attngen` and `python -m attngen`."""

import sys

from attngen.cli import main

sys.exit(main())
