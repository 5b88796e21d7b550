"""``python -m kvmem`` runs the CLI."""

import sys

from kvmem.cli import main

sys.exit(main())
