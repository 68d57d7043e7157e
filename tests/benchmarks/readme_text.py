"""Reading a README's section and its markdown tables, for the tests that tie written numbers to stored
results."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def section(readme: str, title: str) -> str:
    """The text of ``readme`` (a path from the repository root) from the heading holding ``title`` to the
    next heading of level 2 or 3."""
    text = (ROOT / readme).read_text()
    start = text.index(title)
    nxt = re.search(r"\n#{2,3} ", text[start + 1 :])
    return text[start : start + 1 + nxt.start()] if nxt else text[start:]


def table(text: str, first_cell: str) -> list[list[str]]:
    """The body rows of the table in ``text`` whose header starts with ``first_cell``, each a list of its
    cells without the markdown emphasis and code marks."""
    lines = text.split(f"| {first_cell} |")[1].split("\n\n")[0].splitlines()[2:]
    return [[c.strip().strip("*").strip("`") for c in ln.strip("|").split("|")] for ln in lines]


def timing_cells(row: dict) -> tuple[str, ...]:
    """A benchmarks/card80 row's cells as its README tables write them: s/update, generation, scoring and
    training seconds (medians after the warm-up), tokens/s, OOM splits."""
    return (
        f"{row['s_per_update']:.1f}",
        f"{statistics.median(row['gen_times'][1:]):.1f}",
        f"{row['score_s']:.1f}",
        f"{row['train_s']:.1f}",
        f"{row['tokens_per_s']:,.0f}",
        str(row["oom_splits"]),
    )
