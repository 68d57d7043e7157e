"""``rapidfire monitor --pid PID``: a live view of a training process's memory telemetry.

The process is found through the registry entry its ``TelemetryWriter`` wrote
(``<cache>/procs/<pid>.json``, ``<cache>`` = ``$RAPIDFIRE_CACHE_DIR`` or ``~/.cache/rapidfire``). On a GPU
the view adds the process's memory as the driver sees it (NVML, extra ``nvml``), which includes what the
caching allocator does not count (CUDA context, NCCL buffers).

Exit status: 0 shown (``--once``); 130 stopped with Ctrl-C (one line, from ``rapidfire``); 2 bad arguments; 3 no process has this PID; 4 the
process is not a rapidfire training process (no telemetry registered, or an unreadable entry); 5 the process
ended while being watched; 6 its telemetry stream cannot be read (deleted, or not readable by this user).

What a stream says is untrusted: records that are not JSON objects, or whose fields have the wrong type, are
skipped, and control characters (terminal escape sequences included) are removed from every string before
anything is printed.
"""

from __future__ import annotations

import argparse
import math
import re
import time

from rapidfire_hf.cli.json_output import JsonStdout
from rapidfire_hf.utils.units import GIB, MIB

EXIT_OK, EXIT_NO_PROCESS, EXIT_NOT_RAPIDFIRE, EXIT_ENDED, EXIT_STREAM = 0, 3, 4, 5, 6
MIN_INTERVAL_S = 0.1  # below this the view refreshes faster than anyone reads and burns a core
# C0/C1 control characters (ESC starts every terminal escape sequence), DEL, and bidirectional overrides
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < MIN_INTERVAL_S:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a finite number of seconds >= {MIN_INTERVAL_S} (e.g. --interval 5)"
        )
    return value


def _pid(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id (a positive integer)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a process id is a positive integer")
    return value


def add_parser(subparsers) -> None:
    """Register ``rapidfire monitor``."""
    p = subparsers.add_parser(
        "monitor",
        help="live memory/telemetry view of a running rapidfire training process",
        description="A live view of a training process's memory telemetry (and NVML memory on a GPU).",
        epilog="exit status: 0 ok, 2 bad arguments, 3 no such process, 4 not a rapidfire process, "
        "5 process ended while watched, 6 telemetry stream unreadable",
    )
    p.add_argument("--pid", type=_pid, required=True, help="PID of the training process")
    p.add_argument(
        "--interval",
        type=_interval,
        default=5.0,
        help=f"seconds between refreshes, at least {MIN_INTERVAL_S} (default 5)",
    )
    p.add_argument("--once", action="store_true", help="print the current state once and exit")
    p.add_argument("--json", action="store_true", help="JSON instead of a table (one line per refresh)")
    p.set_defaults(func=run)


def nvml_process_memory(pid: int) -> list[dict] | None:
    """GPU memory NVML reports for ``pid``, per GPU; ``None`` when NVML is not installed or has no GPU."""
    from rapidfire_hf.utils.imports import is_available

    if not is_available("pynvml"):
        return None
    import pynvml

    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU on this machine
        return None
    try:
        out = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid:
                    out.append({"gpu": index, "used_bytes": proc.usedGpuMemory})
        return out
    finally:
        pynvml.nvmlShutdown()


def clean(value, depth: int = 0):
    """``value`` with control characters removed from every string (keys included); deep nesting cut."""
    if isinstance(value, str):
        return _CONTROL.sub("", value)
    if depth > 8:
        return None
    if isinstance(value, dict):
        return {clean(str(k)): clean(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v, depth + 1) for v in value]
    return value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_NUMERIC = ("t", "bytes_returned")
_DICTS = ("values", "holdings")


def well_formed(record) -> bool:
    """Whether a record has the shape the summary reads (anything else is skipped)."""
    if not isinstance(record, dict) or not isinstance(record.get("kind", ""), str):
        return False
    if not isinstance(record.get("name", ""), str):
        return False
    if any(k in record and record[k] is not None and not _number(record[k]) for k in _NUMERIC):
        return False
    if any(k in record and record[k] is not None and not isinstance(record[k], dict) for k in _DICTS):
        return False
    step = record.get("step")
    return step is None or isinstance(step, (int, float, str))


def _fold(summary, records: list) -> None:
    summary.update([clean(r) for r in records if well_formed(r)])


def _snapshot(summary, pid: int) -> dict:
    view = summary.to_dict()
    view["pid"] = pid
    view["age_s"] = None if summary.updated is None else round(time.time() - summary.updated, 1)
    device = view.get("device") or ""
    view["nvml"] = nvml_process_memory(pid) if device.startswith("cuda") else None
    return view


def _gib(n) -> str:
    if not _number(n):
        return "-" if n is None else _text(n)
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 4 else f"{n / MIB:.1f} MiB"


def _text(value) -> str:
    """A value as plain text for the table: no control characters, no rich markup."""
    from rich.markup import escape

    return escape(_CONTROL.sub("", str(value)))[:200]


def _fmt(value, spec: str) -> str:
    return format(value, spec) if _number(value) else _text(value)


def render(view: dict):
    """A rich renderable of one snapshot (every value from the stream printed as plain text)."""
    from rich.table import Table

    mem, hold = view["memory"], view["holdings"]
    frag = mem.get("fragmentation")
    table = Table(title=f"rapidfire pid {view['pid']} on {_text(view.get('host') or '?')}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    age = f" ({view['age_s']} s ago)" if view.get("age_s") is not None else ""
    table.add_row("step / phase", f"{_text(view.get('step'))} / {_text(view.get('phase') or '-')}{age}")
    table.add_row("device", _text(view.get("device") or "-"))
    if mem.get("reserved") is not None:
        table.add_row("allocated / reserved", f"{_gib(mem['allocated'])} / {_gib(mem['reserved'])}")
        table.add_row(
            "peak alloc / reserved", f"{_gib(mem['peak_allocated'])} / {_gib(mem['peak_reserved'])}"
        )
        table.add_row("fragmentation", "-" if frag is None else _fmt(frag, ".1%"))
        table.add_row(
            "cached free (reusable)",
            f"{_gib(mem['cached_free_bytes'])}, of which {_gib(mem['inactive_split_bytes'])} in "
            f"{_text(mem['inactive_split_blocks'])} split blocks (not releasable)",
        )
        table.add_row("alloc retries / OOMs", f"{_text(mem['num_alloc_retries'])} / {_text(mem['num_ooms'])}")
    table.add_row("host RSS", _gib(mem.get("rss_bytes")))
    for kind, n in hold.items():
        table.add_row(f"  {_text(kind.replace('_', ' '))}", _gib(n))
    for gpu in view.get("nvml") or []:
        table.add_row(f"NVML gpu {gpu['gpu']}", _gib(gpu["used_bytes"]))
    comp = view["compactions"]
    table.add_row("compactions", f"{comp['count']} (returned {_gib(comp['bytes_returned'])})")
    table.add_row(
        "rollbacks / precision switches / OOM splits",
        f"{view['rollbacks']} / {view['precision_switches']} / {view['oom_splits']}",
    )
    tps = view.get("tokens_per_s")
    table.add_row("tokens/s", "-" if tps is None else _fmt(tps, ",.0f"))
    for key in ("loss", "learning_rate", "grad_norm"):
        if key in view["metrics"]:
            table.add_row(key, _fmt(view["metrics"][key], ".4g"))
    return table


def _emit(view: dict, out: JsonStdout, console) -> None:
    if out.active:
        out.emit(view, indent=None)  # one line per refresh
    else:
        console.print(render(view))


def _stdout_console():
    """A rich Console on stdout whose closed pipe raises BrokenPipeError (main exits 0 quietly) where rich
    would exit with status 1."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _Console()


def run(args) -> int:
    """Body of ``rapidfire monitor``; returns the exit status."""
    with JsonStdout(args.json) as out:  # with --json, what libraries print goes to stderr
        return _run(args, out)


def _run(args, out: JsonStdout) -> int:
    from rich.console import Console

    from rapidfire_hf.memory.summary import (
        NoSuchProcessError,
        NotRapidfireProcessError,
        TelemetrySummary,
        TelemetryTail,
        is_running,
        locate_stream,
    )
    from rapidfire_hf.memory.telemetry import registry_path

    err = Console(stderr=True)
    try:
        stream, entry = locate_stream(args.pid)
    except NoSuchProcessError as e:
        err.print(f"rapidfire monitor: {_text(e)}")
        return EXIT_NO_PROCESS
    except NotRapidfireProcessError as e:
        err.print(f"rapidfire monitor: {_text(e)}")
        return EXIT_NOT_RAPIDFIRE
    except (AttributeError, KeyError, TypeError) as e:  # an entry that is JSON but not a registry entry
        err.print(
            f"rapidfire monitor: process {args.pid}: malformed telemetry entry {registry_path(args.pid)} "
            f"({type(e).__name__}: {_text(e)}); the process may not be a rapidfire run"
        )
        return EXIT_NOT_RAPIDFIRE
    tail, summary, console = TelemetryTail(stream), TelemetrySummary(), _stdout_console()
    try:
        _fold(summary, tail.read_new())
        if args.once:
            _emit(_snapshot(summary, args.pid), out, console)
            return EXIT_OK
        created = entry.get("create_time") if _number(entry.get("create_time")) else None
        return _watch(args, out, tail, summary, console, err, lambda: is_running(args.pid, created))
    except BrokenPipeError:  # `rapidfire monitor | head`: stdout's reader left (main exits 0 quietly)
        raise
    except OSError as e:  # deleted, moved, or another user's private stream
        err.print(
            f"rapidfire monitor: cannot read the telemetry stream {_text(stream)} of process {args.pid} "
            f"({_text(e.strerror or e)}): it was deleted, or it belongs to another user (run the monitor as "
            "the user that runs the training)"
        )
        return EXIT_STREAM


def _watch(args, out: JsonStdout, tail, summary, console, err, alive) -> int:
    def ended() -> int:
        _fold(summary, tail.read_new())  # the last records it wrote before exiting
        view = _snapshot(summary, args.pid)
        view["nvml"] = None
        _emit(view, out, console)
        err.print(f"rapidfire monitor: process {args.pid} ended (last step {summary.step})")
        return EXIT_ENDED

    if args.json:
        while alive():
            _fold(summary, tail.read_new())
            _emit(_snapshot(summary, args.pid), out, console)
            time.sleep(args.interval)
        return ended()
    if not console.is_terminal:  # a file or a pipe: a live view would only be written when it stops
        while alive():
            console.print(render(_snapshot(summary, args.pid)))
            console.file.flush()
            time.sleep(args.interval)
            _fold(summary, tail.read_new())
        return ended()
    from rich.live import Live

    with Live(render(_snapshot(summary, args.pid)), console=console, auto_refresh=False) as live:
        while alive():
            time.sleep(args.interval)
            _fold(summary, tail.read_new())
            live.update(render(_snapshot(summary, args.pid)), refresh=True)
    return ended()
