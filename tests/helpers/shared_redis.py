"""The shared Redis every test machine runs (.ci/run starts it), and clearing a test's keys there."""

import redis

REDIS_URL = "redis://127.0.0.1:6379/0"


def delete_keys(redis_url: str, key_prefix: str) -> None:
    """Delete every key under ``key_prefix`` (``tandem:{key_prefix}:*``)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    keys = list(client.scan_iter(match=f"tandem:{key_prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
