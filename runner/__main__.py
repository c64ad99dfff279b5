"""`python -m runner ...` (same as the `runner` script)."""
import sys

from runner.cli import main

sys.exit(main())
