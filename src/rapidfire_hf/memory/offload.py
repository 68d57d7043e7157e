"""Host offload of saved tensors: checkpointed module inputs (``HostOffloader``) and optimizer state
(``OptimizerStateOffload``), both copied on a side stream next to the compute on CUDA.

``HostOffloader`` is what ``memory.chunked_checkpoint.apply_chunked_checkpointing`` keeps each wrapped
module's input in; ``OptimizerStateOffload`` frees the optimizer state's device memory while it is not
read (the rollout) and brings it back before the next step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from rapidfire_hf.utils.units import GIB


@dataclass
class OffloadStats:
    """What the offloader moved (bytes per direction, summed over the run)."""

    to_host_bytes: int = 0
    to_device_bytes: int = 0
    saved: int = 0
    prefetched: int = 0
    host_buffers_created: int = 0  # host buffers allocated (pinned on CUDA)
    host_buffers_reused: int = 0  # saves served from the offloader's own pool (``reuse_host_buffers``)

    def as_dict(self) -> dict:
        return {
            "to_host_gib": self.to_host_bytes / GIB,
            "to_device_gib": self.to_device_bytes / GIB,
            "tensors_saved": self.saved,
            "prefetched": self.prefetched,
            "host_buffers_created": self.host_buffers_created,
            "host_buffers_reused": self.host_buffers_reused,
        }


class SavedInput:
    """One saved module input (on the host when offloaded, else the device tensor itself), in chunks."""

    __slots__ = ("host", "device_tensor", "device", "shape", "dtype", "chunks", "fetched", "prev", "done")
    __slots__ += ("give_back", "__weakref__")

    def __init__(self, t: torch.Tensor, chunks: list[slice]):
        self.host = self.device_tensor = self.prev = self.give_back = None
        self.device, self.shape, self.dtype, self.chunks = t.device, t.shape, t.dtype, chunks
        self.fetched: dict[int, tuple] = {}  # chunk index -> (device tensor, event) copied ahead
        self.done = False  # every chunk was handed to backward: nothing left to fetch


@dataclass
class HostOffloader:
    """Moves checkpointed module inputs to pinned host memory in forward and back, chunk by chunk, in backward.

    On CUDA the copies run on one side stream: device -> host next to the module's own forward, and
    host -> device one chunk ahead of backward: while backward works on a chunk, the next chunk it
    will need (of the same module, or the first chunk of the module that backward reaches next) is
    copied in. Only two chunks of an offloaded input are ever on the device. Elsewhere (CPU) nothing
    is copied: the input is kept as it is. On the ``meta`` device (memory models) only the shape is
    kept and chunks come back as fresh tensors, as if offloaded.

    Host buffers: by default each save takes a new pinned tensor from torch's caching host allocator and
    drops it after its backward. ``reuse_host_buffers=True`` keeps them in the offloader's own pool instead
    (a buffer goes back to the pool when backward has loaded its last chunk, or when the saved input dies
    without a backward), so from the second step on no pinned memory is allocated. Why it matters: every
    CUDA-graph capture (``torch.cuda.graph``, which the rollout engine enters once per rollout when it is
    released after each) calls ``torch._C._host_emptyCache()``, so the allocator's cached pinned blocks are
    returned to the driver before every training step and the next forward pins its inputs again
    (cudaHostAlloc, page by page; ~2.9 GB for a 1.1B Llama at 64 x 384 tokens). Buffers held by the pool
    are in use, so the capture does not free them. Reuse is safe without any event: the buffer is written (device -> host)
    and read (host -> device) only on the one side stream, so a new save's copy runs after every read of
    the buffer's previous use in stream order; the host never touches the bytes.

    Args:
        enabled: offload at all (False: keep inputs on the device, like plain checkpointing).
        reuse_host_buffers: keep the host buffers in a pool across steps (see above).
        copy_on_cpu: tests only: CPU inputs are copied to separate (unpinned) host buffers and back as if
            offloaded (no streams), so the buffer handling runs on a machine without a GPU.
    """

    enabled: bool = True
    reuse_host_buffers: bool = False
    copy_on_cpu: bool = False
    stats: OffloadStats = field(default_factory=OffloadStats)
    _stream: object = None
    _last: weakref.ref | None = None
    _pool: dict = field(default_factory=dict)  # (shape, dtype) -> free host buffers

    def _copy_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def pooled_bytes(self) -> int:
        """Bytes of host buffers waiting in the pool (``reuse_host_buffers``)."""
        return sum(b.numel() * b.element_size() for bufs in self._pool.values() for b in bufs)

    def _host_buffer(self, s: SavedInput) -> torch.Tensor:
        key = (tuple(s.shape), s.dtype)
        free = self._pool.get(key) if self.reuse_host_buffers else None
        if free:
            host = free.pop()
            self.stats.host_buffers_reused += 1
        else:
            host = torch.empty(s.shape, dtype=s.dtype, pin_memory=s.device.type == "cuda")
            self.stats.host_buffers_created += 1
        if self.reuse_host_buffers:
            # back to the pool after backward's last chunk, or when the saved input dies unused
            s.give_back = weakref.finalize(s, self._pool.setdefault(key, []).append, host)
            s.give_back.atexit = False
        return host

    def save(self, t: torch.Tensor, chunks: list[slice]) -> SavedInput:
        """Keep ``t`` (the input of a module call) for backward, which will read it in ``chunks``."""
        s = SavedInput(t, chunks)
        self.stats.saved += 1
        if not self.enabled or (t.device.type == "cpu" and not self.copy_on_cpu):
            s.device_tensor = t.detach()
        elif t.device.type == "meta":
            pass  # a memory model: nothing to copy, the device bytes are gone as if offloaded
        elif t.device.type == "cpu":
            s.host = self._host_buffer(s)
            s.host.copy_(t.detach())
            self.stats.to_host_bytes += t.numel() * t.element_size()
        else:
            stream = self._copy_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete before it is read
            s.host = self._host_buffer(s)
            with torch.cuda.stream(stream):
                s.host.copy_(t.detach(), non_blocking=True)
            t.record_stream(stream)  # its block is not reused before the copy has read it
            self.stats.to_host_bytes += t.numel() * t.element_size()
        # backward visits modules in reverse: each saved input knows the one saved before it, weakly
        # (a forward whose backward never runs does not keep its inputs alive)
        last = self._last() if self._last is not None else None
        s.prev = weakref.ref(last) if last is not None and not last.done else None
        self._last = weakref.ref(s)
        return s

    def _fetch(self, s: SavedInput, i: int) -> None:
        """Start the host -> device copy of chunk ``i`` of ``s`` on the side stream (no wait)."""
        if s.done or i in s.fetched or s.device_tensor is not None:
            return
        sl = s.chunks[i]
        shape = (sl.stop - sl.start, *s.shape[1:])
        if s.device.type == "meta":
            s.fetched[i] = (torch.empty(shape, dtype=s.dtype, device=s.device), None)
            return
        if s.device.type == "cpu":  # copy_on_cpu (tests)
            s.fetched[i] = (s.host[sl].clone(), None)
            self.stats.to_device_bytes += s.fetched[i][0].numel() * s.fetched[i][0].element_size()
            return
        stream = self._copy_stream(s.device)
        dev = torch.empty(shape, dtype=s.dtype, device=s.device)  # allocated in the compute stream
        stream.wait_stream(torch.cuda.current_stream(s.device))  # its block may still be in use there
        with torch.cuda.stream(stream):
            dev.copy_(s.host[sl], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        s.fetched[i] = (dev, event)
        self.stats.to_device_bytes += dev.numel() * dev.element_size()

    def load(self, s: SavedInput, i: int) -> torch.Tensor:
        """Chunk ``i`` of the saved input on its device; starts copying the chunk backward needs next."""
        if s.device_tensor is not None:
            t = s.device_tensor[s.chunks[i]]
        else:
            self._fetch(s, i)
            t, event = s.fetched.pop(i)
            if event is not None:
                torch.cuda.current_stream(s.device).wait_event(event)
        last = i == len(s.chunks) - 1
        following = (s, i + 1) if not last else ((s.prev() if s.prev is not None else None), 0)
        if following[0] is not None and following[0].device_tensor is None and not following[0].done:
            self._fetch(*following)
            self.stats.prefetched += 1
        if last:
            if s.give_back is not None:
                s.give_back()  # the buffer's reads are queued on the side stream: its next write is too
            s.host = s.device_tensor = s.prev = s.give_back = None  # drop every reference
            s.fetched.clear()
            s.done = True
        return t


class OptimizerStateOffload:
    """Moves an optimizer's state tensors to (pinned) host memory and back, keeping every tensor object.

    Each state storage is copied to the host and resized to 0 bytes, then later resized back and
    copied in: the tensors in ``optimizer.state`` stay the same Python objects (what bitsandbytes and
    RapidFireOptimizer's bucket steppers hold), only their memory is away in between. Meant for the
    rollout, when the state is not read: ``offload()`` before it, ``restore()`` after it, and
    ``wait()`` before the next optimizer step (the gradient pipeline steps during backward).

    ``offload()`` copies on the current stream, so the freed memory is reused only after the copy,
    in stream order, without a host sync. ``restore()`` on CUDA allocates in the current stream and
    copies on a side stream, so the copy runs next to whatever comes before ``wait()`` (the loss
    forward); ``wait()`` makes the current stream wait for it (again no host sync).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (or wrapper exposing ``.state``).
        include_cpu: also move state that lives on the CPU (to another host buffer: for tests only).
    """

    def __init__(self, optimizer, include_cpu: bool = False):
        self.optimizer = optimizer
        self.include_cpu = include_cpu
        self._away: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._stream = None
        self._event = None
        self._device = None
        self.offloads = 0
        self.skipped = 0  # storages left on the device because they cannot be resized
        self.bytes = 0  # of the last offload

    def _storages(self) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    st = value.untyped_storage()
                    if st.nbytes() and st.data_ptr() not in seen:
                        seen[st.data_ptr()] = st  # shared storages (e.g. bitsandbytes' qmaps) once
        return list(seen.values())

    def offload(self) -> int:
        """Copy the state to the host and free its device memory; returns the bytes moved."""
        if self._away:
            raise RuntimeError("optimizer state is already offloaded")
        self.wait()
        moved = 0
        for st in self._storages():
            if st.device.type == "cpu" and not self.include_cpu:
                continue
            n = st.nbytes()
            host = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).untyped_storage()
            host.copy_(st, non_blocking=True)
            try:
                st.resize_(0)
            except RuntimeError:  # a storage that cannot be resized (e.g. paged optimizer state) stays
                self.skipped += 1
                continue
            self._away.append((st, host))
            moved += n
        self.bytes = moved
        self.offloads += 1 if moved else 0
        return moved

    def restore(self) -> None:
        """Bring the state back (same tensor objects, new device memory); see ``wait()``."""
        away, self._away = self._away, []
        cuda = [(st, host) for st, host in away if st.device.type == "cuda"]
        for st, host in away:
            st.resize_(host.nbytes())  # allocated in the current stream
            if st.device.type != "cuda":
                st.copy_(host)
        if not cuda:
            return
        device = self._device = cuda[0][0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)  # the new blocks may still be in use by earlier kernels there
        with torch.cuda.stream(self._stream):
            for st, host in cuda:
                st.copy_(host, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    def wait(self) -> None:
        """Make the current stream wait for the last ``restore()``'s copies (no host sync)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None
