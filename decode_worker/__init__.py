"""The decode worker: receives prompt KV into reserved blocks and streams the generated tokens."""
