"""PPOTrainer's recipe: the modules that put the trainer together from the PPO components of ``ppo/``.

``trainer`` (the loop), ``setup`` (construction), ``planning`` and ``probe_cache`` (the throughput plan),
``checkpoint`` (save, resume checks, load), ``start_report`` (the start table), ``memory_options`` and
``export`` (the Hub export). A component module of ``ppo/`` never imports one of these
(``tests/test_import_contract.py``); import a name from the module that defines it.
"""
