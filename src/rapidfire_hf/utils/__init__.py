"""Small shared helpers (optional-dependency checks, device helpers). Depends on nothing else in the package."""

from rapidfire_hf.utils.imports import is_available, require

__all__ = ["is_available", "require"]
