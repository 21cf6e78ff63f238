"""Index snapshots: one router replica's index, streamed to another that starts up.

A replica that starts (or restarts) next to healthy peers loads a peer's snapshot instead of
routing blind until events rebuild its index, then fills what happened since from each
engine's replay socket (`Router.restore_worker`, ``cpp/events/worker_stream.h`` ``Restore``).

Format ``KVRSNAP`` version 1 (every integer little-endian)::

    magic      8 bytes   b"KVRSNAP\\0"
    version    u32       1
    hlen       u32       length of the header
    header     hlen bytes, JSON (UTF-8): {"block_size": int, "created": unix s,
                         "replica_id": str or null, "workers": int (sections that follow)}
    sections, one per worker:
      slen     u32       length of the section header (> 0)
      section  slen bytes, JSON: {"name": worker name, "state": "exact" | "recovering" |
                         "degraded" | "stale", "seen_seq": bool, "last_seq": int,
                         "have_hash": bool, "last_hash": int, "entries": n}
      entries  n x 24 bytes: engine hash u64 (a byte-string hash: the index's 64-bit digest
                         of it), block key u64, GPU / CPU / disk reference counts u16 each,
                         2 zero bytes
    end        u32       0

``last_seq`` is the sequence number of the last KV-event batch applied to that worker's
part of the index and ``last_hash`` the XXH3-64 of that batch's payload: the restoring
replica asks the engine's replay socket for the batches from ``last_seq`` on and checks that
the engine's copy of batch ``last_seq`` hashes to ``last_hash`` (fencing: a snapshot taken
before an engine restart is never trusted; the restart is detected and the new process is
replayed from 0). Each section is read under that worker's stream lock, so its entries and
its position agree; sections of different workers are taken one after the other.

A reader refuses another magic or version, a ``block_size`` other than its router's, a
truncated stream (no end marker) and an entries length that is not ``24 * n``; it skips
sections of workers it does not have, and restores no worker whose section is ``degraded``
or has no sequence number (those fill from their engines as a fresh replica does).
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, Iterable, Iterator, List, Optional

__all__ = ["MAGIC", "VERSION", "ENTRY_BYTES", "WorkerSection", "Snapshot", "iter_snapshot",
           "aiter_snapshot", "parse_snapshot", "restore_snapshot", "SnapshotError"]

MAGIC = b"KVRSNAP\x00"
VERSION = 1
ENTRY_BYTES = 24
_U32 = struct.Struct("<I")


class SnapshotError(ValueError):
    """A snapshot that cannot be read (bad magic, version, truncation, block size)."""


@dataclass
class WorkerSection:
    """One worker's part of a snapshot: its position and its entries (``ENTRY_BYTES`` each)."""

    name: str
    state: str
    seen_seq: bool
    last_seq: int
    have_hash: bool
    last_hash: int
    entries: bytes

    @property
    def num_entries(self) -> int:
        return len(self.entries) // ENTRY_BYTES


@dataclass
class Snapshot:
    block_size: int
    created: float
    replica_id: Optional[str]
    workers: List[WorkerSection]

    @property
    def num_entries(self) -> int:
        return sum(w.num_entries for w in self.workers)


def _frame(doc: Dict[str, Any]) -> bytes:
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    return _U32.pack(len(raw)) + raw


def _header(router: Any, replica_id: Optional[str]) -> bytes:
    return MAGIC + _U32.pack(VERSION) + _frame(
        {"block_size": router.block_size, "created": time.time(), "replica_id": replica_id,
         "workers": len(router.workers)})


def _section(router: Any, name: str) -> Optional[List[bytes]]:
    try:
        at, entries = router.dump_worker(name)
    except (KeyError, IndexError):  # removed meanwhile
        return None
    doc = {"name": name, "state": at["state"], "seen_seq": at["seen_seq"],
           "last_seq": at["last_seq"], "have_hash": at["have_hash"],
           "last_hash": at["last_hash"], "entries": len(entries) // ENTRY_BYTES}
    return [_frame(doc), entries]


def iter_snapshot(router: Any, replica_id: Optional[str] = None) -> Iterator[bytes]:
    """The router's snapshot as byte chunks (header, then per worker its section header and
    entries, then the end marker). Dumps one worker at a time (O(its blocks))."""
    yield _header(router, replica_id)
    for w in list(router.workers):
        parts = _section(router, w.name)
        if parts is not None:
            yield from parts
    yield _U32.pack(0)


async def aiter_snapshot(router: Any, replica_id: Optional[str] = None) -> AsyncIterator[bytes]:
    """`iter_snapshot` for an event loop: each worker is dumped on a worker thread."""
    yield _header(router, replica_id)
    for w in list(router.workers):
        parts = await asyncio.to_thread(_section, router, w.name)
        if parts is not None:
            for p in parts:
                yield p
    yield _U32.pack(0)


def parse_snapshot(data: bytes) -> Snapshot:
    """Reads a whole snapshot. Raises `SnapshotError` (see the module docstring)."""
    mv = memoryview(data)
    if len(mv) < 16 or bytes(mv[:8]) != MAGIC:
        raise SnapshotError("not a kvroute index snapshot (bad magic)")
    (version,) = _U32.unpack_from(mv, 8)
    if version != VERSION:
        raise SnapshotError(f"snapshot version {version}, this reader reads {VERSION}")
    pos = 12

    def frame() -> Optional[Dict[str, Any]]:
        nonlocal pos
        if pos + 4 > len(mv):
            raise SnapshotError("truncated snapshot (no end marker)")
        (n,) = _U32.unpack_from(mv, pos)
        pos += 4
        if n == 0:
            return None
        if pos + n > len(mv):
            raise SnapshotError("truncated snapshot (a header is cut short)")
        try:
            doc = json.loads(bytes(mv[pos:pos + n]))
        except ValueError as e:
            raise SnapshotError(f"bad snapshot header: {e}") from None
        pos += n
        return doc

    head = frame()
    if head is None:
        raise SnapshotError("snapshot without a header")
    workers: List[WorkerSection] = []
    while True:
        sec = frame()
        if sec is None:
            break
        try:
            n = int(sec["entries"]) * ENTRY_BYTES
            if pos + n > len(mv):
                raise SnapshotError("truncated snapshot (entries cut short)")
            workers.append(WorkerSection(
                name=str(sec["name"]), state=str(sec["state"]), seen_seq=bool(sec["seen_seq"]),
                last_seq=int(sec["last_seq"]), have_hash=bool(sec["have_hash"]),
                last_hash=int(sec["last_hash"]), entries=bytes(mv[pos:pos + n])))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, SnapshotError):
                raise
            raise SnapshotError(f"bad worker section {sec!r}: {e}") from None
        pos += n
    try:
        return Snapshot(block_size=int(head["block_size"]), created=float(head["created"]),
                        replica_id=head.get("replica_id"), workers=workers)
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"bad snapshot header {head!r}: {e}") from None


def restore_snapshot(router: Any, snap: Snapshot,
                     only: Optional[Iterable[str]] = None) -> Dict[str, str]:
    """Restores every worker of ``snap`` that ``router`` has (``only``: just these names).

    Returns
    -------
    dict
        Per worker of the router: ``"restored"``, or why not: ``"not_in_snapshot"``,
        ``"degraded_in_snapshot"``, ``"no_sequence"`` (the peer had seen no sequenced batch),
        ``"busy"`` (the worker is recovering: `Router.restore_worker` refused; try again),
        ``"has_events"`` (it has seen events and has no replay endpoint to catch up with).

    Raises
    ------
    SnapshotError
        ``snap.block_size`` differs from the router's.
    """
    if snap.block_size != router.block_size:
        raise SnapshotError(f"snapshot block_size {snap.block_size} != router's "
                            f"{router.block_size}")
    by_name = {w.name: w for w in snap.workers}
    names = [w.name for w in router.workers]
    if only is not None:
        keep = set(only)
        names = [n for n in names if n in keep]
    out: Dict[str, str] = {}
    for name in names:
        sec = by_name.get(name)
        if sec is None:
            out[name] = "not_in_snapshot"
        elif sec.state == "degraded":
            out[name] = "degraded_in_snapshot"
        elif not sec.seen_seq:
            out[name] = "no_sequence"
        else:
            ok = router.restore_worker(name, sec.entries, sec.last_seq,
                                       sec.last_hash if sec.have_hash else None)
            replay = router._workers[name].replay_endpoint
            out[name] = "restored" if ok else ("busy" if replay else "has_events")
    return out
