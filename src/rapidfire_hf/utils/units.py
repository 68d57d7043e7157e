"""Byte units shared by the parts' reports."""

GIB = 2**30  # bytes in a GiB
MIB = 2**20  # bytes in a MiB
