"""The wire contract: ``.proto`` sources and their generated Python stubs (see ``protos/generate.py``)."""
