"""Shared pieces of the benchmark scripts: environment capture, model shapes, timing, result files, charts.

A script under ``benchmarks/<suite>/`` reaches them with::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    from benchmarks.common import environment, summarize, write_json
"""

from benchmarks.common.charts import bar_chart, save_figure
from benchmarks.common.env import cuda_or_smoke, environment
from benchmarks.common.results import write_csv, write_json
from benchmarks.common.shapes import LLAMA_SHAPES, llama_shape, tokens_per_update
from benchmarks.common.timing import Timer, summarize, timed

__all__ = [
    "LLAMA_SHAPES",
    "Timer",
    "bar_chart",
    "cuda_or_smoke",
    "environment",
    "llama_shape",
    "save_figure",
    "summarize",
    "timed",
    "tokens_per_update",
    "write_csv",
    "write_json",
]
