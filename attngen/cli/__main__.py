"""`python -m attngen.cli`: the `attngen` command."""

import sys

from attngen.cli import main

sys.exit(main())
