"""`tandem check-comm`: can a sampler host reach the trainer, and how fast are both channels?

`tandem check-comm serve` stands in for the trainer on its host; `tandem check-comm connect
--trainer-host HOST` then measures reachability, status latency, weight fetches and group sends
(a live trainer gets no test groups); `tandem check-comm` alone does both on this host.
"""

from __future__ import annotations

import errno
import math
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import zmq

from tandem.config import CurveConfig, PipelineConfig, load_config
from tandem.transport.auth import start_server_auth
from tandem.transport.channel import GroupReceiver, GroupSender
from tandem.transport.weights import Snapshot, WeightClient, WeightServer, WeightSyncError, take_snapshot
from tandem.transport.wire import encode_group
from tandem.types import Completion, Group, TrainerStatus

CHECK_RUN_PREFIX = "check-comm-"  # only a server whose run_id starts so is sent test groups
END_PROMPT_ID = "check-comm-end"  # the last test group: the server answers with a new version
DEFAULT_NUM_GROUPS = 256
NUM_GENERATIONS, COMPLETION_TOKENS, PROMPT_TOKENS = 8, 512, 256  # the shape of one test group
CONNECT_TIMEOUT_S = 3.0
REPLY_TIMEOUT_S = 5.0
NUM_STATUS_CALLS = 50
NUM_FETCHES = 3
FETCH_TIMEOUT_S = 600.0  # a large model over a slow link
DELIVERY_TIMEOUT_S = 30.0


class CheckError(Exception):
    """A problem that stops the check before it measures anything (a taken port, missing keys)."""


class _StepFailed(Exception):
    """One measurement failed; its message is the diagnosis."""


@dataclass(frozen=True)
class CheckSettings:
    trainer_host: str = "127.0.0.1"
    bind_host: str = "*"
    data_port: int = 5555
    sync_port: int = 5556
    megabytes: int = 256  # size of the test weights that `serve` publishes
    seconds: float = 0.0  # serve: stop after this long (0 = until Ctrl-C)
    num_groups: int = DEFAULT_NUM_GROUPS
    curve: CurveConfig = field(default_factory=CurveConfig)


def run_check(args, *, num_groups: int = DEFAULT_NUM_GROUPS) -> int:
    """The `tandem check-comm` command: 0 when every check passed, 1 otherwise."""
    try:
        settings = settings_from_args(args, num_groups=num_groups)
        if args.role == "serve":
            serve(settings)
            return 0
        report = check_local(settings) if args.role == "local" else check_connection(settings)
    except CheckError as err:
        print(f"check-comm: FAILED: {err}")
        return 1
    return 0 if report["passed"] else 1


def settings_from_args(args, *, num_groups: int = DEFAULT_NUM_GROUPS) -> CheckSettings:
    """The flags, completed from --config's pipeline section; an explicit flag wins over the config."""
    # a flag that was not given is None: it comes from --config's pipeline section, or its default
    pipeline = load_config(args.config).pipeline if args.config is not None else PipelineConfig()
    trainer_host = args.trainer_host if args.trainer_host is not None else pipeline.trainer_host
    bind_host = args.bind_host if args.bind_host is not None else pipeline.bind_host
    data_port = args.data_port if args.data_port is not None else pipeline.data_port
    sync_port = args.sync_port if args.sync_port is not None else pipeline.sync_port
    curve = pipeline.curve
    for name, port in (("--data-port", data_port), ("--sync-port", sync_port)):
        if not 0 < port < 65536:
            raise CheckError(f"{name} {port} is not a TCP port (1..65535)")
    if data_port == sync_port:
        raise CheckError(f"--data-port and --sync-port are both {data_port}; the channels need two ports")
    if args.megabytes < 1 or num_groups < 1:
        raise CheckError(f"--megabytes ({args.megabytes}) and the number of groups must be >= 1")
    return CheckSettings(
        trainer_host, bind_host, data_port, sync_port, args.megabytes, args.seconds, num_groups, curve
    )


def _need_keys(curve: CurveConfig, *, trainer: bool, sampler: bool) -> None:
    if not curve.enabled:
        return
    if trainer and None in (curve.server_secret_key, curve.authorized_clients):
        raise CheckError(
            "serving with pipeline.curve needs the trainer's keys: server_secret_key and authorized_clients"
        )
    if sampler and None in (curve.server_public_key, curve.client_secret_key):
        raise CheckError(
            "connecting with pipeline.curve needs a sampler's keys: server_public_key and client_secret_key"
        )


# ----------------------------------------------------------------------------- the stand-in trainer


class CheckServer:
    """Stands in for the trainer: counts the groups it receives and serves random test weights.

    On the end marker group it publishes the same buffer as the next version, so a client
    long-polling the status learns that all its groups arrived (one sender's groups arrive in order).
    """

    def __init__(self, host: str, data_port: int, sync_port: int, megabytes: int, curve: CurveConfig):
        self.run_id = CHECK_RUN_PREFIX + uuid.uuid4().hex[:8]
        self.snapshot = _test_snapshot(megabytes, self.run_id)  # before binding: no client sees v-1
        self.data_address, self.sync_address = f"tcp://{host}:{data_port}", f"tcp://{host}:{sync_port}"
        self.num_groups = self.num_array_bytes = 0
        self._context = zmq.Context()
        self._auth = self._receiver = self._weights = None
        try:
            self._auth = start_server_auth(self._context, curve)
            self._receiver = _bind(
                lambda: GroupReceiver(self.data_address, context=self._context, curve=curve, auth=self._auth),
                "groups",
                self.data_address,
                data_port,
            )
            self._weights = _bind(
                lambda: WeightServer(
                    self.sync_address, run_id=self.run_id, context=self._context, curve=curve, auth=self._auth
                ),
                "weights",
                self.sync_address,
                sync_port,
            )
        except BaseException:
            self.close()
            raise
        self._weights.publish(self.snapshot)

    def serve(self, stop: threading.Event, seconds: float = 0.0, *, quiet: bool = True) -> None:
        """Receive until `stop` is set or `seconds` passed (0: no limit); one thread only."""
        deadline = time.monotonic() + seconds if seconds > 0 else math.inf
        batch_groups = batch_bytes = 0
        while not stop.is_set() and time.monotonic() < deadline:
            group = self._receiver.recv(timeout=0.1)
            if group is None:
                continue
            if group.prompt_id != END_PROMPT_ID:
                num_bytes = _array_bytes(group)
                batch_groups, batch_bytes = batch_groups + 1, batch_bytes + num_bytes
                self.num_groups, self.num_array_bytes = self.num_groups + 1, self.num_array_bytes + num_bytes
                continue
            manifest = replace(self.snapshot.manifest, version=self.snapshot.manifest.version + 1)
            self.snapshot = Snapshot(manifest, self.snapshot.flat)  # the buffer is never modified
            self._weights.publish(self.snapshot)
            if not quiet:
                print(
                    f"  {group.sampler_id}: {batch_groups} groups ({batch_bytes / 2**20:.1f} MB of token ids "
                    f"and log-probs) arrived; published version {manifest.version}",
                    flush=True,
                )
            batch_groups = batch_bytes = 0

    def close(self) -> None:
        if self._weights is not None:
            self._weights.close()
        if self._receiver is not None:
            self._receiver.close()
        if self._auth is not None:
            self._auth.stop()
        # destroy, not term: a socket a failed constructor left open would make term() hang
        self._context.destroy(linger=0)


def _bind(make: Callable[[], Any], what: str, address: str, port: int) -> Any:
    try:
        return make()
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise  # e.g. a missing CURVE key file: its own message says what to do
        raise CheckError(
            f"port {port} is already in use on this host (another trainer or check-comm?); "
            "pick another with --data-port/--sync-port"
        ) from err
    except (ValueError, zmq.ZMQError) as err:
        raise CheckError(
            f"cannot bind the {what} channel to {address}: {err} (--bind-host must be an address "
            "of this host, or *)"
        ) from err


def _test_snapshot(megabytes: int, run_id: str) -> Snapshot:
    weight = torch.rand(megabytes * 2**20 // 4, generator=torch.Generator().manual_seed(0))
    return take_snapshot([("check_comm.weight", weight)], version=0, run_id=run_id)


def _array_bytes(group: Group) -> int:
    num_values = len(group.prefix_token_ids)
    for c in group.completions:
        num_values += len(c.generated_token_ids) + c.old_policy_log_probs.numel()
        num_values += 0 if c.ref_policy_log_probs is None else c.ref_policy_log_probs.numel()
    return 4 * num_values  # int32 token ids, float32 log-probs


def serve(settings: CheckSettings) -> None:
    _need_keys(settings.curve, trainer=True, sampler=False)
    host, dp, sp = settings.bind_host, settings.data_port, settings.sync_port
    server = CheckServer(host, dp, sp, settings.megabytes, settings.curve)
    until = f"for {settings.seconds:g} s" if settings.seconds > 0 else "until Ctrl-C"
    print(
        f"check-comm serve: groups on {server.data_address}, {settings.megabytes} MB of test weights on "
        f"{server.sync_address} (run {server.run_id}), {until}\n"
        f"  on the sampler host: tandem check-comm connect --trainer-host {socket.gethostname()} "
        f"--data-port {dp} --sync-port {sp}",
        flush=True,
    )
    try:
        server.serve(threading.Event(), settings.seconds, quiet=False)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    print(f"check-comm serve: stopped; {server.num_groups} test groups received in all")


def check_local(settings: CheckSettings) -> dict[str, Any]:
    """Serve on 127.0.0.1 in a background thread, connect to it, stop it; the report, as `check_connection`."""
    settings = replace(settings, trainer_host="127.0.0.1", bind_host="127.0.0.1")
    _need_keys(settings.curve, trainer=True, sampler=True)
    server = CheckServer(
        "127.0.0.1", settings.data_port, settings.sync_port, settings.megabytes, settings.curve
    )
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), name="check-comm-serve", daemon=True)
    thread.start()
    try:
        report = check_connection(settings, server_groups=lambda: server.num_groups)
    finally:
        stop.set()
        thread.join()
        server.close()
    report["server_num_groups"] = server.num_groups
    return report


# ----------------------------------------------------------------------------- the client


def check_connection(
    settings: CheckSettings, *, server_groups: Callable[[], int] | None = None
) -> dict[str, Any]:
    """Test the trainer (or `serve`) at settings.trainer_host, printing as it goes; the numbers.

    `server_groups` (local check only) counts the groups the server received, to compare.
    """
    _need_keys(settings.curve, trainer=False, sampler=True)
    host = settings.trainer_host
    print(f"check-comm: trainer {host}, groups on port {settings.data_port}, weights on {settings.sync_port}")
    report: dict[str, Any] = {"trainer_host": host, "problems": []}
    found = (reach(host, settings.data_port), reach(host, settings.sync_port))
    problems = list(dict.fromkeys(p for p in found if p))  # an unknown host is one problem, not two
    if not problems:
        print(
            f"  reach    {host}:{settings.data_port} and {host}:{settings.sync_port} accept TCP connections"
        )
        context = zmq.Context()
        try:
            client = WeightClient(f"tcp://{host}:{settings.sync_port}", context=context, curve=settings.curve)
            _measure(settings, context, client, report, server_groups)
        except _StepFailed as err:
            problems.append(str(err))
        finally:
            context.destroy(linger=0)  # closes the client's and the sender's sockets too
    for problem in problems:
        print(f"  FAIL     {problem}")
    report["problems"] = problems
    report["passed"] = not problems
    print("check-comm: passed" if not problems else f"check-comm: FAILED ({len(problems)} problem(s))")
    return report


def reach(host: str, port: int) -> str | None:
    """None when host:port accepts a TCP connection, else what is wrong and what to do."""
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except socket.gaierror as err:
        return f"unknown host {host!r} ({err}): check --trainer-host (a name this host resolves, or an IP)"
    except ConnectionRefusedError:
        return f"nothing listens on {where}: start `tandem check-comm serve` (or the trainer) there, or check the port"
    except TimeoutError:
        return f"{where} unreachable: wrong host, or a firewall drops the port (no answer in {CONNECT_TIMEOUT_S:g} s)"
    except OSError as err:
        if err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"{where} unreachable: wrong host, or a firewall drops the port ({err.strerror})"
        return f"cannot connect to {where}: {err}"


def _measure(
    settings: CheckSettings,
    context: zmq.Context,
    client: WeightClient,
    report: dict[str, Any],
    server_groups: Callable[[], int] | None,
) -> None:
    status, latency_ms = _status_round_trips(client)
    report.update(run_id=status.run_id, latency_ms_median=latency_ms[0], latency_ms_p95=latency_ms[1])
    print(
        f"  latency  status round trip: median {latency_ms[0]:.2f} ms, p95 {latency_ms[1]:.2f} ms "
        f"({NUM_STATUS_CALLS} calls; run {status.run_id}, version {status.version})"
    )
    total_bytes, rates = _fetch_rates(client, status)
    report.update(
        sync_megabytes=total_bytes / 2**20,
        sync_gb_per_s=statistics.median(rates),
        sync_best_gb_per_s=max(rates),
    )
    print(
        f"  weights  {total_bytes / 2**20:.0f} MB fetched {NUM_FETCHES} times: median "
        f"{statistics.median(rates):.2f} GB/s, best {max(rates):.2f} GB/s"
    )
    if not status.run_id.startswith(CHECK_RUN_PREFIX):
        report["data_skipped"] = (
            f"run {status.run_id} is a live trainer, which must never get test groups; its group port "
            "was only checked for reachability (use `tandem check-comm serve` there for group bandwidth)"
        )
        print(f"  groups   skipped: {report['data_skipped']}")
        return
    report["data_skipped"] = None
    num_groups, seconds, num_bytes = _send_groups(settings, context, client)
    report.update(
        data_num_groups=num_groups,
        data_megabytes=num_bytes / 2**20,
        data_groups_per_s=num_groups / seconds,
        data_gb_per_s=num_bytes / seconds / 1e9,
    )
    print(
        f"  groups   {num_groups} groups of {NUM_GENERATIONS} x {COMPLETION_TOKENS} tokens "
        f"({num_bytes / 2**20:.1f} MB): {num_groups / seconds:.0f} groups/s, {num_bytes / seconds / 1e9:.3f} GB/s"
    )
    if server_groups is not None and server_groups() != num_groups:
        raise _StepFailed(f"the server counted {server_groups()} of the {num_groups} groups sent")


def _status_round_trips(client: WeightClient) -> tuple[TrainerStatus, tuple[float, float]]:
    status = client.status(timeout_s=REPLY_TIMEOUT_S)
    if status is None and client.handshake_problem() is not None:
        raise _StepFailed(client.handshake_problem())
    if status is None:
        raise _StepFailed(
            f"{client.address} accepts TCP but sent no status within {REPLY_TIMEOUT_S:g} s: it is not a "
            "tandem trainer or check-comm serve, or the CURVE keys do not match (both sides need "
            "pipeline.curve, and the trainer's authorized_clients must hold this sampler's public key)"
        )
    times_ms = []
    for _ in range(NUM_STATUS_CALLS):
        start = time.perf_counter()
        if client.status(timeout_s=REPLY_TIMEOUT_S) is None:
            raise _StepFailed(f"{client.address} stopped answering status requests")
        times_ms.append((time.perf_counter() - start) * 1000)
    times_ms.sort()
    p95 = times_ms[math.ceil(0.95 * len(times_ms)) - 1]
    return status, (statistics.median(times_ms), p95)


def _fetch_rates(client: WeightClient, status: TrainerStatus) -> tuple[int, list[float]]:
    """Bytes of one fetch and the GB/s of each of NUM_FETCHES fetches."""
    rates, total_bytes = [], 0
    for _ in range(NUM_FETCHES):
        start = time.perf_counter()
        try:
            fetched = client.fetch(timeout_s=FETCH_TIMEOUT_S)
        except WeightSyncError as err:
            raise _StepFailed(f"weight fetch failed: {err}") from err
        if fetched is None:
            if status.version < 0:
                raise _StepFailed("the trainer has published no weights yet; try again once it has")
            raise _StepFailed(f"no complete weights from {client.address} within {FETCH_TIMEOUT_S:g} s")
        total_bytes = fetched[0].total_bytes
        rates.append(total_bytes / (time.perf_counter() - start) / 1e9)
    return total_bytes, rates


def _send_groups(
    settings: CheckSettings, context: zmq.Context, client: WeightClient
) -> tuple[int, float, int]:
    """Send the test groups and the end marker; (groups, seconds until the server confirmed, bytes)."""
    before = client.status(timeout_s=REPLY_TIMEOUT_S)
    if before is None:
        raise _StepFailed(f"{client.address} stopped answering status requests")
    groups = _test_groups(settings.num_groups, before.version)
    num_bytes = sum(sum(memoryview(f).nbytes for f in encode_group(g)) for g in groups)
    end = Group(f"{before.run_id}-end", END_PROMPT_ID, "", [], [], before.version, groups[0].sampler_id)
    address = f"tcp://{settings.trainer_host}:{settings.data_port}"
    with GroupSender(address, context=context, curve=settings.curve) as sender:
        start = time.perf_counter()
        try:
            for group in [*groups, end]:
                sender.send(group, timeout=DELIVERY_TIMEOUT_S)
        except TimeoutError as err:  # its message says why when the trainer refused the handshake
            raise _StepFailed(str(err)) from err
        after = client.status(newer_than=before.version, run_id=before.run_id, wait_s=DELIVERY_TIMEOUT_S)
        seconds = time.perf_counter() - start
    if after is None or after.run_id != before.run_id or after.version <= before.version:
        raise _StepFailed(
            f"the server did not confirm the {len(groups)} groups within {DELIVERY_TIMEOUT_S:g} s "
            "(is the group port served by the same host as the weight port?)"
        )
    return len(groups), seconds, num_bytes


def _test_groups(num_groups: int, policy_version: int) -> list[Group]:
    """Groups shaped like real ones; they share their (never modified) completions."""
    generator = torch.Generator().manual_seed(0)
    completions = [
        Completion(
            text=" tok" * COMPLETION_TOKENS,  # about as long as real decoded text
            generated_token_ids=torch.randint(0, 150_000, (COMPLETION_TOKENS,), generator=generator).tolist(),
            is_finished=True,
            reward=1.0,
            reward_info={"answer": 1.0},
            old_policy_log_probs=-5 * torch.rand(COMPLETION_TOKENS, generator=generator),
            ref_policy_log_probs=-5 * torch.rand(COMPLETION_TOKENS, generator=generator),
        )
        for _ in range(NUM_GENERATIONS)
    ]
    prefix_token_ids = torch.randint(0, 150_000, (PROMPT_TOKENS,), generator=generator).tolist()
    sampler_id, now = f"check-comm-{socket.gethostname()}", time.time()
    return [
        Group(
            f"check-comm-{i}",
            f"check-comm-{i}",
            " tok" * PROMPT_TOKENS,
            prefix_token_ids,
            completions,
            policy_version,
            sampler_id,
            now,
        )
        for i in range(num_groups)
    ]
