"""``rapidfire monitor --pid PID``: a live view of a training process's memory telemetry.

The process is found through the registry entry its ``TelemetryWriter`` wrote
(``<cache>/procs/<pid>.json``, ``<cache>`` = ``$RAPIDFIRE_CACHE_DIR`` or ``~/.cache/rapidfire``). On a GPU
the view adds the process's memory as the driver sees it (NVML, extra ``nvml``), which includes what the
caching allocator does not count (CUDA context, NCCL buffers).

Exit status: 0 shown (``--once``) or stopped with Ctrl-C; 3 no process has this PID; 4 the process is not a
rapidfire training process (no telemetry registered); 5 the process ended while being watched.
"""

from __future__ import annotations

import json
import time

EXIT_OK, EXIT_NO_PROCESS, EXIT_NOT_RAPIDFIRE, EXIT_ENDED = 0, 3, 4, 5


def add_parser(subparsers) -> None:
    """Register ``rapidfire monitor``."""
    p = subparsers.add_parser(
        "monitor",
        help="live memory/telemetry view of a running rapidfire training process",
        description="A live view of a training process's memory telemetry (and NVML memory on a GPU).",
        epilog="exit status: 0 ok, 3 no such process, 4 not a rapidfire process, 5 process ended while watched",
    )
    p.add_argument("--pid", type=int, required=True, help="PID of the training process")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes (default 5)")
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


def _snapshot(summary, pid: int) -> dict:
    view = summary.to_dict()
    view["pid"] = pid
    view["age_s"] = None if summary.updated is None else round(time.time() - summary.updated, 1)
    device = view.get("device") or ""
    view["nvml"] = nvml_process_memory(pid) if device.startswith("cuda") else None
    return view


def _gib(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.1f} MiB"


def render(view: dict):
    """A rich renderable of one snapshot."""
    from rich.table import Table

    mem, hold = view["memory"], view["holdings"]
    frag = mem.get("fragmentation")
    table = Table(title=f"rapidfire pid {view['pid']} on {view.get('host') or '?'}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    age = f" ({view['age_s']} s ago)" if view.get("age_s") is not None else ""
    table.add_row("step / phase", f"{view.get('step')} / {view.get('phase') or '-'}{age}")
    table.add_row("device", str(view.get("device") or "-"))
    if mem.get("reserved") is not None:
        table.add_row("allocated / reserved", f"{_gib(mem['allocated'])} / {_gib(mem['reserved'])}")
        table.add_row(
            "peak alloc / reserved", f"{_gib(mem['peak_allocated'])} / {_gib(mem['peak_reserved'])}"
        )
        table.add_row("fragmentation", "-" if frag is None else f"{frag:.1%}")
        table.add_row(
            "cached free (reusable)",
            f"{_gib(mem['cached_free_bytes'])}, of which {_gib(mem['inactive_split_bytes'])} in "
            f"{mem['inactive_split_blocks']} split blocks (not releasable)",
        )
        table.add_row("alloc retries / OOMs", f"{mem['num_alloc_retries']} / {mem['num_ooms']}")
    table.add_row("host RSS", _gib(mem.get("rss_bytes")))
    for kind, n in hold.items():
        table.add_row(f"  {kind.replace('_', ' ')}", _gib(n))
    for gpu in view.get("nvml") or []:
        table.add_row(f"NVML gpu {gpu['gpu']}", _gib(gpu["used_bytes"]))
    comp = view["compactions"]
    table.add_row("compactions", f"{comp['count']} (returned {_gib(comp['bytes_returned'])})")
    table.add_row(
        "rollbacks / precision switches / OOM splits",
        f"{view['rollbacks']} / {view['precision_switches']} / {view['oom_splits']}",
    )
    tps = view.get("tokens_per_s")
    table.add_row("tokens/s", "-" if tps is None else f"{tps:,.0f}")
    for key in ("loss", "learning_rate", "grad_norm"):
        if key in view["metrics"]:
            table.add_row(key, f"{view['metrics'][key]:.4g}")
    return table


def _emit(view: dict, as_json: bool, console) -> None:
    if as_json:
        print(json.dumps(view), flush=True)
    else:
        console.print(render(view))


def run(args) -> int:
    """Body of ``rapidfire monitor``; returns the exit status."""
    from rich.console import Console

    from rapidfire_hf.memory.summary import (
        NoSuchProcessError,
        NotRapidfireProcessError,
        TelemetrySummary,
        TelemetryTail,
        is_running,
        locate_stream,
    )

    err = Console(stderr=True)
    try:
        stream, entry = locate_stream(args.pid)
    except NoSuchProcessError as e:
        err.print(f"rapidfire monitor: {e}")
        return EXIT_NO_PROCESS
    except NotRapidfireProcessError as e:
        err.print(f"rapidfire monitor: {e}")
        return EXIT_NOT_RAPIDFIRE
    tail, summary, console = TelemetryTail(stream), TelemetrySummary(), Console()
    summary.update(tail.read_new())
    if args.once:
        _emit(_snapshot(summary, args.pid), args.json, console)
        return EXIT_OK
    created = entry.get("create_time")
    try:
        return _watch(args, tail, summary, console, err, lambda: is_running(args.pid, created))
    except KeyboardInterrupt:
        return EXIT_OK


def _watch(args, tail, summary, console, err, alive) -> int:
    def ended() -> int:
        summary.update(tail.read_new())  # the last records it wrote before exiting
        view = _snapshot(summary, args.pid)
        view["nvml"] = None
        _emit(view, args.json, console)
        err.print(f"rapidfire monitor: process {args.pid} ended (last step {summary.step})")
        return EXIT_ENDED

    if args.json:
        while alive():
            summary.update(tail.read_new())
            _emit(_snapshot(summary, args.pid), True, console)
            time.sleep(args.interval)
        return ended()
    from rich.live import Live

    with Live(render(_snapshot(summary, args.pid)), console=console, auto_refresh=False) as live:
        while alive():
            time.sleep(args.interval)
            summary.update(tail.read_new())
            live.update(render(_snapshot(summary, args.pid)), refresh=True)
    return ended()
