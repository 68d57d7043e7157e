"""The embedded demo task: a tokenizer built in code, a tiny Llama-style policy built from a config,
synthetic prompts and a rule-based reward that PPO learns in minutes on a laptop CPU.

The same builders give the test-suite its tiny models (no downloads anywhere); ``tiny_setup()`` returns
the tokenizer, policy, value model, reward function and prompts the README and docs snippets run on.
"""

from rapidfire_hf.demo.task import (
    DemoTask,
    TinySetup,
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_reward_model,
    build_tiny_value_model,
    make_prompt_dataset,
    tiny_setup,
    vowel_reward,
)

__all__ = [
    "DemoTask",
    "build_char_tokenizer",
    "build_tiny_llama",
    "build_tiny_reward_model",
    "build_tiny_value_model",
    "TinySetup",
    "make_prompt_dataset",
    "tiny_setup",
    "vowel_reward",
]
