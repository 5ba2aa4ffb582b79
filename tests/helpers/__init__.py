"""Helpers the tests share, one module per job; fixtures stay in the ``conftest.py`` files and
call these.

- ``paths``: the repository's root.
- ``shared_redis``: the shared Redis every test machine runs, and deleting a test's keys there.
- ``worker_config``: the published worker settings the routing and registry tests use.
- ``models``: Hugging Face models as oracles (tiny random ones, and the real SmolLM2), and a
  paged-KV driver of our model.
- ``prompts``: the prompts the real-model tests compare on.
- ``engine``: running engine requests to their end, and the disaggregated path.
- ``paged_inputs``: random paged-cache inputs for the kernel tests.
- ``kv_peers``: two workers' KV data planes in one process (pools, a ``TransferKV`` server, NIXL
  agents, a sender's stream to tamper with).
- ``gateway``: a real gateway on a background thread, workers registered in Redis, a hand-moved clock.
- ``workers``: prefill and decode workers (and a gateway) in the test's process.
- ``cluster``: a real local cluster of processes, and its gRPC utilities.
- ``otlp_receiver``: an OTLP trace receiver on loopback.
- ``kustomize_render``: the offline kustomize renderer of the Kubernetes tests.
"""
