"""KServe v2 / Open Inference Protocol (``inference.GRPCInferenceService``), as Triton defines it:
vendored protos (BSD-3-Clause, ``LICENSE``) and their stubs; the gateway serves it beside
``tandem.v1.Gateway`` (:mod:`gateway.kserve`)."""
