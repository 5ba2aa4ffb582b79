"""The public gRPC gateway and the cluster state it routes on.

``registry``: live workers and their load in Redis (heartbeats with TTL); ``prefix_index``:
which worker caches which block hash; ``router``: the prefill/decode picks and the
``ClusterView`` facade the gateway calls per request.
"""
