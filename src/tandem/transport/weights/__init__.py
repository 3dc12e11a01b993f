"""Weight sync, trainer -> samplers (DESIGN.md section 3): the two sides' interfaces and one factory each.

The trainer holds a `WeightPublisher` (`weight_publisher`), a sampler a `WeightSource`
(`weight_source`); `pipeline.sync_method` picks the method behind them and nothing else asks:
- `zmq` (`zmq_server`, `zmq_client`): the newest snapshot's chunks straight from the trainer's
  memory, or, to a sampler on the trainer's host, the snapshot's shared file lent for a while;
- `fs` (`filesystem`, the seed's method): versions written atomically as folders, old ones pruned.
Both carry the trainer's `TrainerStatus` (newest version, starved, finished, the takes it announces;
its schema is `wire.status_to_json`), and a sampler applies a version between generation batches
only. `snapshot` holds what both share: the flat, hashed snapshot buffers and `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
import zmq

from tandem.config import PipelineConfig
from tandem.transport.auth import CountingAuthenticator
from tandem.transport.weights.filesystem import STATUS_FILE, FsWeightReader, FsWeightWriter, list_versions
from tandem.transport.weights.snapshot import (
    ALIGN,
    CHUNK_BYTES,
    SHM_DIR,
    Snapshot,
    SnapshotBuffers,
    WeightSyncError,
    load_weights,
    new_run_id,
    no_shared_buffer_message,
    reserve,
    shared_prefix,
    snapshot_layout,
    take_snapshot,
    tensor_view,
    verify_chunks,
)
from tandem.transport.weights.zmq_client import WeightClient, ZmqWeightSource
from tandem.transport.weights.zmq_server import (
    DEFAULT_SYNC_PORT,
    LEASE_S,
    LOCAL_HOSTS,
    WeightServer,
    local_sync_address,
    sync_address,
)
from tandem.types import TrainerStatus, WeightsManifest

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "DEFAULT_SYNC_PORT",
    "LEASE_S",
    "LOCAL_HOSTS",
    "SHM_DIR",
    "STATUS_FILE",
    "FsWeightReader",
    "FsWeightWriter",
    "Snapshot",
    "SnapshotBuffers",
    "WeightClient",
    "WeightPublisher",
    "WeightServer",
    "WeightSource",
    "WeightSyncError",
    "ZmqWeightSource",
    "list_versions",
    "load_weights",
    "local_sync_address",
    "new_run_id",
    "no_shared_buffer_message",
    "reserve",
    "shared_prefix",
    "snapshot_layout",
    "sync_address",
    "take_snapshot",
    "tensor_view",
    "verify_chunks",
    "weight_publisher",
    "weight_source",
]


class WeightPublisher(Protocol):
    """The trainer's side (`WeightServer`, `FsWeightWriter`): publishes versions and its status."""

    where: str  # where samplers find the weights, for logs

    def publish_version(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, dtype: str | None = None
    ) -> WeightsManifest:
        """Snapshot the tensors (cast to `dtype`; None keeps each one's) and publish them as `version`."""
        ...

    def set_status(self, **changes) -> None:
        """Change fields of the status samplers see (`TrainerStatus`: starved, finished, the schedule)."""
        ...

    def untold(self, window_s: float = 120.0) -> int:
        """Samplers heard from lately that have not yet been told the run finished."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for the trainer's metrics row (zmq: weights_lent, weights_sent; fs: none)."""
        ...

    def close(self) -> None: ...


class WeightSource(Protocol):
    """A sampler's side (`ZmqWeightSource`, `FsWeightReader`): the trainer's status and its weights."""

    where: str  # where the weights come from, for logs
    same_host: bool  # whether the trainer lends its snapshots to this sampler (no bytes sent)

    def status(
        self,
        *,
        newer_than: int | None = None,
        run_id: str | None = None,
        wait_s: float = 0.0,
        timeout_s: float = 5.0,
    ) -> TrainerStatus | None:
        """The trainer's status; with `newer_than`, waits up to `wait_s` for news (a newer version,
        another run, finished). None when there is no answer."""
        ...

    def handshake_problem(self) -> str | None:
        """Why the trainer refuses this sampler's handshakes (CURVE keys); None while it does not."""
        ...

    def load_newest(
        self, policy: torch.nn.Module, params: dict[str, torch.Tensor] | None, status: TrainerStatus
    ) -> WeightsManifest | None:
        """Load the newest version into `policy` (`params`: the tensors that travel, None = all);
        its manifest, or None when there is none or the trainer went away (ask the status again).
        Raises WeightSyncError for a corrupt version or a bad reply."""
        ...

    def close(self) -> None: ...


def _sync_dir(pipeline: PipelineConfig, run_dir: Path) -> Path:
    return Path(pipeline.sync_dir) if pipeline.sync_dir else run_dir / "weights"


def weight_publisher(
    pipeline: PipelineConfig,
    run_dir: Path,
    run_id: str,
    context: zmq.Context,
    auth: CountingAuthenticator | None,
) -> WeightPublisher:
    """The trainer's publisher for `pipeline.sync_method`: zmq binds the sync port (snapshots in
    shared-memory files, lent to same-host samplers); fs writes versions under the sync folder."""
    if pipeline.sync_method == "zmq":
        return WeightServer(
            f"tcp://{pipeline.bind_host}:{pipeline.sync_port}",
            run_id=run_id,
            context=context,
            curve=pipeline.curve,
            auth=auth,
            shared_prefix=shared_prefix(run_id),
        )
    return FsWeightWriter(_sync_dir(pipeline, run_dir), run_id=run_id, keep=pipeline.sync_keep_versions)


def weight_source(pipeline: PipelineConfig, run_dir: Path, context: zmq.Context) -> WeightSource:
    """A sampler's source for `pipeline.sync_method`: the trainer's sync port, or the sync folder."""
    if pipeline.sync_method == "zmq":
        return ZmqWeightSource(
            pipeline.trainer_host, pipeline.sync_port, context=context, curve=pipeline.curve
        )
    return FsWeightReader(_sync_dir(pipeline, run_dir))
