"""`PYTHONPATH=benches python -m rx_bench bench|bench-proxy ...` from a clone."""

import sys

from rx_bench.cli import main

sys.exit(main())
