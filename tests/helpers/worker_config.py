"""The published worker settings the routing and registry tests use (a pool's ``WorkerConfig``)."""

from cluster.registry import WorkerConfig
from engine.block_hash import hash_seed

BLOCK_SIZE = 4
CONFIG = WorkerConfig("test/model", BLOCK_SIZE, 1024, "bfloat16", hash_seed("test/model", BLOCK_SIZE, "bfloat16"),
                      32000)
