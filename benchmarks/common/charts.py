"""Charts of stored results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_chart(path, labels: list[str], values: list[float], title: str, xlabel: str, reference=None) -> Path:
    """Horizontal bars, one per label, each annotated with its value and, given ``reference``, its ratio
    to it (for example tokens/s as a multiple of stock TRL's in the same run)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.5))
    ax.barh(range(len(labels)), values, color=["C7" if v == reference else "C0" for v in values])
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    for y, v in enumerate(values):
        note = f" {v:,.0f}" + (f" ({v / reference:.2f}x)" if reference else "")
        ax.text(v, y, note, va="center", fontsize=8)
    ax.set_xlim(0, max(values, default=1) * 1.3)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path = save_figure(fig, path)
    plt.close(fig)
    return path


def save_figure(fig, path, colors: int = 128) -> Path:
    """Save a matplotlib figure as a palette PNG (``colors`` entries, no dithering): charts have few colours,
    and the palette file is about a third of the size of matplotlib's RGBA one."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    image = Image.open(buffer).convert("RGB")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, optimize=True
    )
    return path
