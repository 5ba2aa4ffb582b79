"""``package tandem.v1``: the public Gateway API (``gateway_pb2``) and the internal worker and KV transfer services (``worker_pb2``, ``kvtransfer_pb2``)."""
