"""Checkpoints of ``PPOTrainer`` and ``PPOSweep``: one atomic writer, one manifest, one set of readers.

- :mod:`rapidfire_hf.checkpoint.writer`: the atomic folder writer and finding the latest checkpoint;
- :mod:`rapidfire_hf.checkpoint.manifest`: the manifest (every file's SHA-256, the run's identity and
  settings), written last, and its verification;
- :mod:`rapidfire_hf.checkpoint.readers`: ``.pt`` (weights only), safetensors and JSON readers, the
  non-finite check;
- :mod:`rapidfire_hf.checkpoint.identity`: the run's identity (base model fingerprint, tokenizer hash,
  adapter and value-head config) and the settings a resume must keep;
- :mod:`rapidfire_hf.checkpoint.errors`: the errors.

``rapidfire_hf.ppo.recipe.checkpoint`` and ``rapidfire_hf.sweep.checkpoint`` say what each entry point writes and
how it restores it; neither reads a file on its own.
"""
