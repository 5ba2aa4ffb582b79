"""The wire contract: ``.proto`` sources and their generated Python stubs (see ``protos/compile.py``)."""

# The FileDescriptorSet of Tandem's own .proto files with their comments, for server reflection.
DESCRIPTOR_SET = "protos/tandem/v1/descriptors.binpb"
