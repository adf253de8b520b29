"""`python -m alchemist.audit audit generated/<model>.py [--gguf ...]` (the same as `alchemist audit`)."""

import sys

from alchemist.audit.cli import main

sys.exit(main())
