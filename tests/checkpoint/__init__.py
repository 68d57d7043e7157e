"""Tests of the shared checkpoint writer, manifest, readers and identity (``rapidfire_hf.checkpoint``)."""
