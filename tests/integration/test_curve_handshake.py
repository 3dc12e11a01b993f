"""CURVE key mismatches over real ZeroMQ sockets and real keys: the sampler side says which setting
is wrong (and keeps saying it, and keeps trying), the trainer side counts and logs whom it refused."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

zmq = pytest.importorskip("zmq")

from tandem.config import CurveConfig, load_config  # noqa: E402
from tandem.sampler import worker  # noqa: E402
from tandem.sampler.worker import Sampler, TrainerGone  # noqa: E402
from tandem.trainer.experience import RemoteExperience  # noqa: E402
from tandem.transport.auth import RETRY_S, keygen, start_server_auth  # noqa: E402
from tandem.transport.channel import GroupReceiver, GroupSender, free_tcp_port  # noqa: E402
from tandem.transport.weights import WeightClient, WeightServer, take_snapshot  # noqa: E402
from tandem.types import Completion, Group  # noqa: E402

REFUSED_IN_S = 5.0  # a refusal is diagnosed within this long (ZeroMQ reports it in milliseconds)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """keys/: the run's trainer and sampler; other/: a stranger's pair of each."""
    root = tmp_path_factory.mktemp("curve")
    keygen(root / "keys", ["trainer", "sampler"])
    keygen(root / "other", ["trainer", "sampler"])
    return root


def trainer_curve(keys: Path, authorized: str = "keys/authorized") -> CurveConfig:
    return CurveConfig(
        server_secret_key=str(keys / "keys/trainer.key_secret"), authorized_clients=str(keys / authorized)
    )


def sampler_curve(keys: Path, server: str = "keys", client: str = "keys") -> CurveConfig:
    return CurveConfig(
        server_public_key=str(keys / server / "trainer.key"),
        client_secret_key=str(keys / client / "sampler.key_secret"),
    )


class Trainer:
    """The trainer's two sockets and its ZAP handler, as `RemoteExperience` opens them."""

    def __init__(self, curve: CurveConfig, data_port: int, sync_port: int) -> None:
        self.context = zmq.Context()
        self.auth = start_server_auth(self.context, curve)
        self.receiver = GroupReceiver(
            f"tcp://127.0.0.1:{data_port}", context=self.context, curve=curve, auth=self.auth
        )
        self.server = WeightServer(
            f"tcp://127.0.0.1:{sync_port}", run_id="run", context=self.context, curve=curve, auth=self.auth
        )
        self.server.publish(take_snapshot([("w", torch.ones(8))], version=0, run_id="run"))

    def close(self) -> None:
        self.server.close()
        self.receiver.close()
        if self.auth is not None:
            self.auth.stop()
        self.context.term()


class Client:
    """A sampler's two sockets."""

    def __init__(self, curve: CurveConfig, data_port: int, sync_port: int) -> None:
        self.context = zmq.Context()
        self.weights = WeightClient(f"tcp://127.0.0.1:{sync_port}", context=self.context, curve=curve)
        self.sender = GroupSender(f"tcp://127.0.0.1:{data_port}", context=self.context, curve=curve, linger=0)

    def close(self) -> None:
        self.weights.close()
        self.sender.close()
        self.context.term()


def a_group() -> Group:
    completion = Completion("7", [5, 6], True, 1.0, {}, torch.full((2,), -0.5), torch.full((2,), -0.5), 0.0)
    return Group("g0", "p0", "3 + 4?", [1, 2], [completion], 0, "s0")


@pytest.fixture
def ports() -> tuple[int, int]:
    data_port, sync_port = free_tcp_port(), free_tcp_port()
    while sync_port == data_port:
        sync_port = free_tcp_port()
    return data_port, sync_port


# (trainer's curve, sampler's curve, what the sampler is told, what the trainer counts)
MISMATCHES = {
    "client key not authorised": (
        lambda k: trainer_curve(k),
        lambda k: sampler_curve(k, client="other"),
        ["refused this sampler's CURVE key", "pipeline.curve.client_secret_key", "authorized_clients"],
        "refused_from",
    ),
    "wrong server public key": (
        lambda k: trainer_curve(k),
        lambda k: sampler_curve(k, server="other"),
        ["pipeline.curve.server_public_key", "other/trainer.key", "server_secret_key"],
        "failed",
    ),
    "CURVE off on the sampler": (
        lambda k: trainer_curve(k),
        lambda k: CurveConfig(),
        ["requires CURVE", "pipeline.curve.server_public_key", "pipeline.curve.client_secret_key"],
        "failed",
    ),
    "CURVE off on the trainer": (
        lambda k: CurveConfig(),
        lambda k: sampler_curve(k),
        ["CURVE", "pipeline.curve.server_secret_key"],
        None,
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_key_mismatch_is_diagnosed_and_retried_until_fixed(keys, ports, case):
    server_curve, client_curve, told, counted = MISMATCHES[case]
    trainer = Trainer(server_curve(keys), *ports)
    client = Client(client_curve(keys), *ports)
    try:
        # a refused client does not wait out its timeout: it learns nothing more by waiting
        assert client.weights.status(timeout_s=REFUSED_IN_S) is None
        problem = client.weights.handshake_problem()
        assert problem is not None and all(words in problem for words in told), problem
        with pytest.raises(TimeoutError) as err:  # (the first few may queue before a refusal is known)
            for _ in range(2 * client.sender.sndhwm):
                client.sender.send(a_group(), timeout=1.0)
        assert all(words in str(err.value) for words in told), err.value
        assert trainer.receiver.recv(timeout=0.2) is None
        if counted is None:
            return
        refused = trainer.auth.refused
        assert refused > 0 and sum(getattr(trainer.auth, counted).values()) > 0
        # not once then silence: the client keeps trying (every RETRY_S), and keeps being refused
        deadline = time.monotonic() + 10 * RETRY_S
        while trainer.auth.refused == refused and time.monotonic() < deadline:
            assert client.weights.status(timeout_s=REFUSED_IN_S) is None
        assert trainer.auth.refused > refused
        problem = client.weights.handshake_problem()  # (a hang-up's guess may have become a certainty)
        assert problem is not None and all(words in problem for words in told), problem
        summary = trainer.auth.summary()
        assert summary is not None and ("127.0.0.1" in summary) == (counted == "refused_from")
    finally:
        client.close()
        trainer.close()


def test_the_right_keys_work_and_nothing_is_refused(keys, ports):
    trainer = Trainer(trainer_curve(keys), *ports)
    client = Client(sampler_curve(keys), *ports)
    try:
        status = client.weights.status(timeout_s=REFUSED_IN_S)
        assert status is not None and status.run_id == "run"
        client.sender.send(a_group(), timeout=REFUSED_IN_S)
        assert trainer.receiver.recv(timeout=REFUSED_IN_S).group_id == "g0"
        assert client.weights.handshake_problem() is None and client.sender.handshake_problem() is None
        assert trainer.auth.refused == 0 and trainer.auth.summary() is None
    finally:
        client.close()
        trainer.close()


def test_a_refused_sampler_gets_through_once_the_trainer_accepts_its_key(keys, ports, tmp_path):
    # ZeroMQ drops a refused connection for good; the client must try again by itself
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    curve = CurveConfig(
        server_secret_key=str(keys / "keys/trainer.key_secret"), authorized_clients=str(authorized)
    )
    trainer = Trainer(curve, *ports)
    client = Client(sampler_curve(keys), *ports)
    try:
        assert client.weights.status(timeout_s=REFUSED_IN_S) is None
        assert "refused this sampler's CURVE key" in client.weights.handshake_problem()
        trainer.close()
        (authorized / "sampler.key").write_bytes((keys / "keys/sampler.key").read_bytes())
        trainer = Trainer(curve, *ports)  # restarted, the sampler's key authorised now
        status = None
        for _ in range(10):
            status = client.weights.status(timeout_s=REFUSED_IN_S)
            if status is not None:
                break
        assert status is not None and status.run_id == "run"
        assert client.weights.handshake_problem() is None
        client.sender.send(a_group(), timeout=REFUSED_IN_S)
        assert trainer.receiver.recv(timeout=REFUSED_IN_S).group_id == "g0"
    finally:
        client.close()
        trainer.close()


def test_sampler_and_trainer_both_report_a_refused_key(
    keys, tmp_path, tiny_model_dir, tiny_model, monkeypatch, caplog
):
    """A real `Sampler` with a key the trainer does not know, against a real `RemoteExperience`."""
    monkeypatch.setattr(worker, "SILENT_WARN_S", 1.0)  # repeats every second instead of every 30
    data_port, sync_port = free_tcp_port(), free_tcp_port()
    common = [
        f"output_dir={tmp_path}",
        "experiment_name=refused",
        f"model.policy={tiny_model_dir}",
        "sampling.num_generations=2",
        "sampling.batch_size=2",
        "grpo.prompts_per_step=1",
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=1",
        "data.num_examples=8",
        "pipeline.bind_host=127.0.0.1",
        f"pipeline.data_port={data_port}",
        f"pipeline.sync_port={sync_port}",
    ]
    server = [
        f"pipeline.curve.server_secret_key={keys / 'keys/trainer.key_secret'}",
        f"pipeline.curve.authorized_clients={keys / 'keys/authorized'}",
        "pipeline.data_timeout_s=1",
    ]
    client = [
        f"pipeline.curve.server_public_key={keys / 'keys/trainer.key'}",
        f"pipeline.curve.client_secret_key={keys / 'other/sampler.key_secret'}",
        "pipeline.trainer_timeout_s=4",
    ]
    trainer_cfg = load_config(None, [*common, *server])
    trainer_cfg.run_dir.mkdir(parents=True)
    caplog.set_level(logging.INFO)
    experience = RemoteExperience(trainer_cfg, trainer_cfg.run_dir, tiny_model)
    sampler = Sampler(load_config(None, [*common, *client]), sampler_id="intruder", device="cpu")
    try:
        with pytest.raises(TrainerGone) as gone:
            sampler.wait_for_turn()
        with pytest.raises(TimeoutError) as silent:
            experience.next_groups(1)
        stats = experience._stats([], experience.dropped, 0.0)
    finally:
        sampler.close()
        experience.close(finished=False)

    # the sampler: told at once, then again and again, naming the settings and the check
    told = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tandem.sampler.worker" and r.levelname == "WARNING"
    ]
    assert len(told) >= 2, told
    for message in told:
        assert "refused this sampler's CURVE key" in message
        assert (
            "pipeline.curve.client_secret_key" in message and "pipeline.curve.authorized_clients" in message
        )
        assert f"tandem check-comm connect --trainer-host 127.0.0.1 --data-port {data_port}" in message
    assert not any("does not answer" in message for message in told)
    assert "refused for" in str(gone.value) and "pipeline.curve.client_secret_key" in str(gone.value)

    # the trainer: every refusal counted with the peer's address, logged once per address
    refused = experience.auth.refused_from["127.0.0.1"]
    assert refused >= 3 and stats["auth_refused"] == refused
    logged = [
        r.getMessage() for r in caplog.records if "refused a CURVE handshake from 127.0.0.1" in r.getMessage()
    ]
    assert len(logged) == 1 and "pipeline.curve.authorized_clients" in logged[0]
    assert "handshakes refused from 127.0.0.1" in str(silent.value)
    assert "a sampler with the wrong key?" in str(silent.value)


def test_under_curve_an_oversize_frame_is_counted_as_a_closed_connection(keys):
    """With CURVE the authenticator owns the socket's monitor; it counts the connection ZeroMQ
    closes for an authorised sampler's oversize frame, and the receiver reports it."""
    context = zmq.Context()
    curve = trainer_curve(keys)
    auth = start_server_auth(context, curve)
    receiver = GroupReceiver("tcp://127.0.0.1:0", context=context, curve=curve, auth=auth, max_bytes=4096)
    client = context.socket(zmq.PUSH)
    client.setsockopt(zmq.LINGER, 0)
    from tandem.transport.auth import configure_client

    configure_client(client, sampler_curve(keys))
    client.connect(receiver.address)
    try:
        client.send(b"x" * 100_000)
        deadline = time.monotonic() + REFUSED_IN_S
        while receiver.connections_closed == 0 and time.monotonic() < deadline:
            assert receiver.recv(timeout=0.1) is None
        assert receiver.connections_closed >= 1 and auth.refused == 0
    finally:
        client.close()
        receiver.close()
        auth.stop()
        context.term()
