"""Tandem protobuf packages."""
