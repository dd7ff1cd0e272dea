"""`python -m routed_experts`: the same command line as `routed-experts`."""

import sys

from routed_experts.cli import main

sys.exit(main())
