"""The benchmark harness behind `routed-experts demo`, `bench` and `bench-proxy`: synthetic
rollouts, the side-by-side codec benchmark and its baselines, and the proxy's load, fault and
reliability rounds. Internal: the command loads it on demand; nothing here is API."""
