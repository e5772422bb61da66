"""Counts the bytes of live tensor storages on one device while code runs, and where the peak was (DESIGN.md
section 10).

A `TorchDispatchMode`: every op's output storage that the counter has not seen is added with its size and dropped
(by a weak reference) when its last tensor dies. Views and in-place results share a storage and count once. It
works the same on real tensors (a real CPU step, the reference the planner is checked against) and on fake ones
(the planner's trace), so both numbers come from the same counter.

torch's own `MemTracker` hooks every parameter's gradient and refuses frozen bases, and the allocator statistics
exist on CUDA only; counting storages needs neither.

Each storage carries a tag, which says what it is at the peak:
- set on creation from the current phase ("weights", "inputs", "ema", "forward", "backward", "optimizer", ...);
- `retag_live(old, new)` at a phase's end: forward tensors still alive are "activations", optimizer tensors still
  alive are "optimizer" (its states), `retag(tensors, "grads")` names the gradients;
- a "forward", "backward" or "optimizer" storage freed within its phase becomes "transient".
The peak's storages are remembered (the entries, shared, so later tags apply), taken just before the first free
after a new peak: that is exactly the state at the peak.

Host memory (a block swap's weights, offloaded activations: the planner runs with the CPU standing for the device)
is counted apart: storages made inside `host()` and storages passed to `move_to_host` count as pinned host memory.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from modules.planner.ModulePlaces import ModulePlaces

TRANSIENT_WHEN_FREED = ("forward", "backward", "optimizer")
_DEVICE = torch.ops.prim.device.default


class _Entry:
    __slots__ = ("nbytes", "tag", "op", "module")

    def __init__(self, nbytes: int, tag: str, op: str = "", module: str = ""):
        # op / module: what made it and where (the peak's largest storages, `benchmark plan --peak-detail`)
        self.nbytes, self.tag, self.op, self.module = nbytes, tag, op, module


class StorageCounter(TorchDispatchMode):
    def __init__(self, device_type: str = "cpu", places: ModulePlaces | None = None):
        """`places`: names the module each storage was made in (slower; `benchmark plan --peak-detail`)."""
        super().__init__()
        self.device_type = device_type
        self.places = places
        self.phase = "setup"
        self.live: dict[int, _Entry] = {}
        self.total = 0
        self.peak = 0
        self.peak_phase = "setup"
        self.peak_entries: list[_Entry] = []
        self._peak_pending = False
        self._host_depth = 0
        self.host_live: dict[int, int] = {}
        self.host_total = 0
        self.host_peak = 0
        # "phase" or "phase:section" -> [peak bytes, storages alive at it] since reset_peak: a composed plan
        # (composed_trace.py) extrapolates each one's peak on its own, as they grow differently with the blocks
        self.phase_peaks: dict[str, list] = {}
        self._phase_pending = False
        self.section = ""

    # ---- what the planner calls ------------------------------------------------------------------------------

    def set_phase(self, phase: str) -> None:
        self._snapshot_if_pending()   # a phase's peak is what was alive at it, not what the next phase adds
        self.phase, self.section = phase, ""

    def set_section(self, section: str) -> None:
        """A part of the phase whose peak is kept apart (the backward pass of one block); tags stay the phase's."""
        self._snapshot_if_pending()
        self.section = section

    @property
    def _bucket(self) -> str:
        return f"{self.phase}:{self.section}" if self.section else self.phase

    def track(self, tensors, tag: str | None = None) -> None:
        """Counts tensors made before the counter ran (or retags them when already counted)."""
        for tensor in map(_local, tensors):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
                entry = self._add(tensor.untyped_storage(), tag or self.phase)
                if tag is not None:
                    entry.tag = tag

    def retag(self, tensors, tag: str) -> None:
        for tensor in map(_local, tensors):
            if isinstance(tensor, torch.Tensor):
                entry = self.live.get(id(tensor.untyped_storage()))
                if entry is not None:
                    entry.tag = tag

    def retag_live(self, old: str, new: str) -> None:
        for entry in self.live.values():
            if entry.tag == old:
                entry.tag = new

    def move_to_host(self, tensors) -> None:
        """These storages live in (pinned) host memory: no longer device memory."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            entry = self.live.pop(id(storage), None)
            if entry is not None:
                self.total -= entry.nbytes
            if id(storage) not in self.host_live:
                self._add_host(storage)

    def reset_peak(self) -> None:
        self.peak, self.peak_phase, self.peak_entries, self._peak_pending = self.total, self.phase, [], True
        self.phase_peaks = {self._bucket: [self.total, []]}
        self._phase_pending = True

    @contextlib.contextmanager
    def peak_kept(self):
        """Within: allocations are counted, but the peak (and what was alive at it) stays the one before (work
        that is planned apart, such as a sampling preview between steps)."""
        self._snapshot_if_pending()
        kept = self.peak, self.peak_phase, self.peak_entries, {k: list(v) for k, v in self.phase_peaks.items()}
        try:
            yield
        finally:
            self._snapshot_if_pending()
            self.peak, self.peak_phase, self.peak_entries, self.phase_peaks = kept
            self._peak_pending = self._phase_pending = False

    @contextlib.contextmanager
    def host(self):
        """Storages made inside are host memory (an offloaded activation's copy)."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def breakdown(self) -> dict[str, int]:
        """Bytes per tag at the peak."""
        self._snapshot_if_pending()
        totals: dict[str, int] = defaultdict(int)
        for entry in self.peak_entries:
            totals[entry.tag] += entry.nbytes
        return dict(totals)

    def phase_breakdowns(self) -> dict[str, dict[str, int]]:
        """Per phase (and section) since reset_peak, in the order they ran: bytes per tag at its own peak."""
        self._snapshot_if_pending()
        result = {}
        for phase, (_peak, entries) in self.phase_peaks.items():
            totals: dict[str, int] = defaultdict(int)
            for entry in entries:
                totals[entry.tag] += entry.nbytes
            result[phase] = dict(totals)
        return result

    def largest_at_peak(self, count: int | None = 10) -> list[tuple[int, str, str, str]]:
        """(bytes, tag, op that made it, module it was made in) of the largest storages at the peak (None: all)."""
        self._snapshot_if_pending()
        entries = sorted(self.peak_entries, key=lambda e: e.nbytes, reverse=True)[:count]
        return [(e.nbytes, e.tag, e.op, e.module) for e in entries]

    def live_by_tag(self) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for entry in self.live.values():
            totals[entry.tag] += entry.nbytes
        return dict(totals)

    # ---- counting --------------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and len(args) == 1 and getattr(args[0], "fake_mode", None) is not None:
            # a fake tensor's device: most of what a fake trace dispatches (autograd asks it of every tensor it
            # meets); no storage is made, and the answer is FakeTensorMode's (its `_device_handler`) without its
            # dispatch, which took most of a plan's time
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            tensor = _local(tensor)
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
                storage = tensor.untyped_storage()
                if self._host_depth:
                    if id(storage) not in self.host_live:
                        self._add_host(storage)
                elif id(storage) not in self.live and id(storage) not in self.host_live:
                    self._add(storage, self.phase, str(func), self.places.where() if self.places else "")
        return out

    def _add(self, storage, tag: str, op: str = "", module: str = "") -> _Entry:
        key = id(storage)
        entry = self.live.get(key)
        if entry is not None:
            return entry
        entry = _Entry(storage.nbytes(), tag, op, module)
        self.live[key] = entry
        self.total += entry.nbytes
        weakref.finalize(storage, self._free, key, entry)
        self._raised()
        return entry

    def _raised(self) -> None:
        if self.total > self.peak:
            self.peak, self.peak_phase, self._peak_pending = self.total, self.phase, True
        if self.phase_peaks:
            kept = self.phase_peaks.get(self._bucket)
            if kept is None or self.total > kept[0]:
                self.phase_peaks[self._bucket] = [self.total, kept[1] if kept else []]
                self._phase_pending = True

    def _free(self, key: int, entry: _Entry) -> None:
        if self.live.get(key) is not entry:
            return   # moved to the host, or the id was reused by a newer storage
        self._snapshot_if_pending()
        del self.live[key]
        self.total -= entry.nbytes
        if entry.tag in TRANSIENT_WHEN_FREED:
            entry.tag = "transient"

    def _snapshot_if_pending(self) -> None:
        entries = None
        if self._peak_pending:
            self.peak_entries = entries = list(self.live.values())
            self._peak_pending = False
        if self._phase_pending:
            self.phase_peaks[self._bucket][1] = entries if entries is not None else list(self.live.values())
            self._phase_pending = False

    def _add_host(self, storage) -> None:
        key = id(storage)
        self.host_live[key] = storage.nbytes()
        self.host_total += storage.nbytes()
        self.host_peak = max(self.host_peak, self.host_total)
        weakref.finalize(storage, self._free_host, key)

    def _free_host(self, key: int) -> None:
        self.host_total -= self.host_live.pop(key, 0)


def _local(tensor):
    """A DTensor's own shard (a sharded run's parameters, gradients and optimizer states): the wrapper reports the
    whole tensor's size but holds only its local tensor's storage."""
    from torch.distributed.tensor import DTensor
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def following_resizes(counter: StorageCounter):
    """Within: a storage resized in place counts with its new size. FSDP2 frees a gathered block's weights with
    `untyped_storage().resize_(0)` and gathers them again into the same storage (no op the dispatch mode sees), so
    a real sharded step is counted right only with this."""
    original = torch.UntypedStorage.resize_

    def resize(storage, size):
        result = original(storage, size)
        entry = counter.live.get(id(storage))
        if entry is not None and entry.nbytes != size:
            if size < entry.nbytes:
                counter._snapshot_if_pending()   # the state just before a shrink may be the peak
            counter.total += size - entry.nbytes
            entry.nbytes = size
            counter._raised()
        return result

    torch.UntypedStorage.resize_ = resize
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original
