"""The benchmark suite of rapidfire_hf (scripts run from a source checkout; not part of the wheel)."""
