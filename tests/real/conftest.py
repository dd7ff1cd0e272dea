"""The live tests need a real engine: `make test-engines` makes its environment and names it
(RX_VLLM_PYTHON, RX_VLLM_RELEASE); elsewhere (`make test`, the wheel checks) they are not
collected at all, and the recorded bodies stand in (tests/test_real_vllm.py)."""

import os

collect_ignore_glob = [] if os.environ.get("RX_VLLM_PYTHON") else ["test_live_*.py"]
