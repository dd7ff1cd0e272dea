"""The benchmark harness, run from a clone and never shipped in the wheel: the side-by-side
codec benchmark and its baselines (`bench`), and the proxy's load, fault, reliability and
session rounds (`bench-proxy`). `python -m rx_bench` with `benches/` on the path
(the Makefile's bench targets; tests/conftest.py puts it there for the tests)."""
