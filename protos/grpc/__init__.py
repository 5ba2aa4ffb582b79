"""The standard gRPC services every Tandem server speaks (health checking with ``List``, server
reflection v1 and v1alpha), compiled here from their published definitions so that one
descriptor pool holds them beside Tandem's own (the grpcio-health-checking and
grpcio-reflection packages lack ``Health.List`` and reflection v1)."""
