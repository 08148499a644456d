"""`python -m lopa` is the `lopa` command."""

import sys

from lopa.cli import main

sys.exit(main())
