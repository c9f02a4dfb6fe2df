"""`python -m attngen`: the `attngen` command."""

import sys

from attngen.cli import main

sys.exit(main())
