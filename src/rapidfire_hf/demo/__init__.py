"""The embedded demo task: a tokenizer built in code, a tiny Llama-style policy built from a config,
synthetic prompts and a rule-based reward that PPO learns in minutes on a laptop CPU.

The same builders give the test-suite its tiny models (no downloads anywhere).
"""

from rapidfire_hf.demo.task import (
    DemoTask,
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_reward_model,
    build_tiny_value_model,
    make_prompt_dataset,
    vowel_reward,
)

__all__ = [
    "DemoTask",
    "build_char_tokenizer",
    "build_tiny_llama",
    "build_tiny_reward_model",
    "build_tiny_value_model",
    "make_prompt_dataset",
    "vowel_reward",
]
