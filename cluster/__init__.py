"""What the gateway and the workers share: settings, the Redis registry and prefix index, routing,
channels, health, metrics and the worker server scaffolding."""
