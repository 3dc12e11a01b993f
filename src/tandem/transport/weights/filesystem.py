"""The `fs` weight-sync method (the seed's): `FsWeightWriter` writes `vNNNNNNNN/{weights.bin,
manifest.json}` into a temporary folder, fsyncs and renames it, then prunes old versions, and keeps
the trainer's status in `status.json`; `FsWeightReader` only ever sees complete versions and checks
every chunk's hash. The folder may be shared between hosts (e.g. over NFS).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from tandem.atomic import atomic_dir, atomic_write_text
from tandem.transport.weights.snapshot import (
    Snapshot,
    SnapshotBuffers,
    WeightSyncError,
    is_news,
    load_weights,
    verify_chunks,
)
from tandem.transport.wire import (
    WireError,
    manifest_from_json,
    manifest_to_json,
    status_from_json,
    status_to_json,
)
from tandem.types import TrainerStatus, WeightsManifest

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"


def _version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def list_versions(root: Path) -> list[tuple[int, Path]]:
    """Complete versions, oldest first (temporary folders of an interrupted write are ignored)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if name.startswith("v") and name[1:].isdigit() and (path / "manifest.json").is_file():
            found.append((int(name[1:]), path))
    return sorted(found)


class FsWeightWriter:
    """Trainer side of the `fs` method: versions as folders, written atomically, old ones pruned.
    A `WeightPublisher` (`publish_version`); `publish` writes a snapshot taken elsewhere."""

    def __init__(self, root: str | Path, *, run_id: str, keep: int = 2) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.where = f"files in {self.root}"
        self.run_id = run_id
        self.keep = keep
        self._buffers = SnapshotBuffers()  # heap buffers: versions are files, nothing is lent
        self._status = TrainerStatus(version=-1, run_id=run_id)
        self._write_status()

    def publish_version(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, dtype: str | None = None
    ) -> WeightsManifest:
        """Snapshot `named_tensors` as `version` and write it (hashed: readers check every chunk)."""
        snapshot = self._buffers.snapshot(
            named_tensors, publisher=self, version=version, run_id=self.run_id, dtype=dtype, hashed=False
        )
        self.publish(snapshot)
        return snapshot.manifest

    def stats(self) -> dict[str, int]:
        return {}  # nothing to count: samplers read the files

    def publish(self, snapshot: Snapshot) -> None:
        snapshot = snapshot.hashed()  # readers check every chunk

        def write(tmp: Path) -> None:
            with open(tmp / "weights.bin", "wb") as f:
                f.write(memoryview(snapshot.flat.numpy()))
            (tmp / "manifest.json").write_text(json.dumps(manifest_to_json(snapshot.manifest)))

        atomic_dir(_version_dir(self.root, snapshot.manifest.version), write)
        self._prune(self.keep)
        self._status = replace(self._status, version=snapshot.manifest.version)
        self._write_status()

    def _prune(self, keep: int) -> int:
        """Remove all but the newest `keep` versions; returns the bytes freed. A sampler may be
        reading a pruned version: its open file stays readable until closed (POSIX)."""
        freed = 0
        for _, path in list_versions(self.root)[: len(list_versions(self.root)) - keep]:
            for file in path.iterdir():
                freed += file.stat().st_size
                file.unlink(missing_ok=True)
            path.rmdir()
        return freed

    def busy(self, flat: torch.Tensor) -> bool:
        return False  # published versions are files: the buffer is free once publish returns

    def untold(self, window_s: float = 120.0) -> int:
        return 0  # status.json stays behind: a sampler reads "finished" whenever it looks

    def set_status(self, **changes) -> None:
        old = self._status
        self._status = replace(old, **changes)
        if self._status != old:
            self._write_status()

    def _write_status(self) -> None:
        atomic_write_text(self.root / STATUS_FILE, json.dumps(status_to_json(self._status)), fsync=False)

    def close(self) -> None:
        """A finished run's versions go too (its samplers have heard it is over, and the trained
        model is in final/); status.json stays and says so. An interrupted run keeps its newest
        versions for the samplers that outlive it."""
        self._buffers.close()
        if self._status.finished:
            freed = self._prune(0)
            if freed:
                log.info("removed the published weight versions from %s (%.2f GB)", self.root, freed / 1e9)


class FsWeightReader:
    """Sampler side of the `fs` method (the folder may be shared between hosts, e.g. over NFS)."""

    POLL_S = 0.05

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.where = f"weights in {self.root}"
        self.same_host = False  # (files: nothing is lent)
        self._flat: torch.Tensor | None = None
        self.dropped: Counter[str] = Counter()  # status files that failed to validate, by reason

    def _read_status(self) -> TrainerStatus | None:
        try:
            return status_from_json(json.loads((self.root / STATUS_FILE).read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None  # not written yet, or (a foreign writer) caught mid-write: no status yet
        except WireError as err:
            self.dropped[err.reason] += 1
            return None

    def status(
        self,
        *,
        newer_than: int | None = None,
        run_id: str | None = None,
        wait_s: float = 0.0,
        timeout_s: float = 5.0,
    ) -> TrainerStatus | None:
        deadline = time.monotonic() + wait_s
        while True:
            status = self._read_status()
            done = newer_than is None or (status is not None and is_news(status, newer_than, run_id))
            if done or time.monotonic() >= deadline:
                return status
            time.sleep(self.POLL_S)

    def fetch(self, *, timeout_s: float = 60.0) -> tuple[WeightsManifest, torch.Tensor] | None:
        for _ in range(5):  # the newest version may be pruned under our feet: take the next newest
            versions = list_versions(self.root)
            if not versions:
                return None
            try:
                return self._read(versions[-1][1])
            except FileNotFoundError:
                continue
        return None

    def load_newest(
        self, policy: torch.nn.Module, params: dict[str, torch.Tensor] | None, status: TrainerStatus
    ) -> WeightsManifest | None:
        """Read the newest complete version and load it into `policy` (`params`: the tensors that
        travel); its manifest, or None when there is none. WeightSyncError: a corrupt version."""
        got = self.fetch()
        if got is None:
            return None
        load_weights(policy, got[1], got[0], params)
        return got[0]

    def _read(self, path: Path) -> tuple[WeightsManifest, torch.Tensor]:
        try:
            manifest = manifest_from_json(json.loads((path / "manifest.json").read_text()))
        except (json.JSONDecodeError, WireError) as err:
            raise WeightSyncError(f"{path}/manifest.json is malformed: {err}") from err
        if self._flat is None or self._flat.numel() != manifest.total_bytes:
            self._flat = torch.empty(manifest.total_bytes, dtype=torch.uint8)
        with open(path / "weights.bin", "rb") as f:
            size = f.readinto(memoryview(self._flat.numpy()))
            if size != manifest.total_bytes or f.read(1):
                raise WeightSyncError(f"{path}/weights.bin does not have {manifest.total_bytes} bytes")
        verify_chunks(self._flat, manifest)
        return manifest, self._flat

    def handshake_problem(self) -> str | None:
        return None  # files: no handshake

    def close(self) -> None:
        pass
