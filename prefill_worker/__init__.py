"""The prefill worker: computes prompt KV, pushes it to a decode worker, returns the first token."""
