"""The short table a trainer prints once at start: what is on, what was skipped and why, and where the
telemetry and the process registry are. ``enable_rapidfire`` and ``PPOTrainer`` both print it."""

from __future__ import annotations

from rapidfire_hf.utils.cache import cache_dir


def start_table(title: str, on: list[str], skipped: list[str], watched: bool = True) -> str:
    """The lines of the start table.

    Args:
        title: the first line, e.g. ``"rapidfire on PPOTrainer:"``.
        on: what is on, one item a line.
        skipped: what is off or not installed, each with its reason.
        watched: add where the process registry and the telemetry are (when something writes them).
    """
    lines = [title]
    lines += [f"  on       {item}" for item in on]
    lines += [f"  skipped  {item}" for item in skipped]
    if watched:
        lines.append(
            f"  process registry {cache_dir() / 'procs'} (RAPIDFIRE_CACHE_DIR moves it), telemetry in "
            "<output_dir>/telemetry (RAPIDFIRE_TELEMETRY_DIR moves it); watch with rapidfire monitor --pid PID"
        )
    return "\n".join(lines)
