"""`python -m eagle3_runner.runner ...` (same as the `runner` script)."""
import sys

from eagle3_runner.runner.cli import main

sys.exit(main())
