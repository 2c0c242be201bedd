"""`python -m services` is the `specsplit` command."""

import sys

from .cli import main

sys.exit(main())
