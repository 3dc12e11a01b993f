"""`tandem check-comm` over real sockets on 127.0.0.1: measurements, diagnoses, live-trainer safety."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

zmq = pytest.importorskip("zmq")

from tandem.cli import build_parser, main  # noqa: E402
from tandem.config import CurveConfig  # noqa: E402
from tandem.transport.auth import keygen  # noqa: E402
from tandem.transport.channel import GroupReceiver, free_tcp_port  # noqa: E402
from tandem.transport.check import (  # noqa: E402
    CheckServer,
    CheckSettings,
    check_connection,
    check_local,
    settings_from_args,
)
from tandem.transport.weights import WeightServer, take_snapshot  # noqa: E402


def two_ports() -> tuple[int, int]:
    data_port = free_tcp_port()
    sync_port = free_tcp_port()
    while sync_port == data_port:
        sync_port = free_tcp_port()
    return data_port, sync_port


def test_local_check_measures_both_channels():
    data_port, sync_port = two_ports()
    settings = CheckSettings(data_port=data_port, sync_port=sync_port, megabytes=8, num_groups=12)
    report = check_local(settings)
    assert report["passed"] and report["problems"] == []
    assert report["run_id"].startswith("check-comm-")
    assert 0 < report["latency_ms_median"] <= report["latency_ms_p95"]
    assert report["sync_megabytes"] == 8  # 8 MiB of float32: no padding, one 64-byte-aligned tensor
    assert 0 < report["sync_gb_per_s"] <= report["sync_best_gb_per_s"]
    assert report["data_skipped"] is None
    assert report["data_num_groups"] == 12 and report["server_num_groups"] == 12
    # 8 completions x 512 tokens x (id + 2 log-probs) x 4 bytes, plus headers and the prompt
    assert report["data_megabytes"] > 12 * 8 * 512 * 12 / 2**20
    assert report["data_groups_per_s"] > 0 and report["data_gb_per_s"] > 0


def test_local_check_through_the_cli(capsys):
    data_port, sync_port = two_ports()
    argv = ["check-comm", "--data-port", str(data_port), "--sync-port", str(sync_port), "--megabytes", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "latency" in out and "GB/s" in out and "groups/s" in out
    assert out.rstrip().endswith("check-comm: passed")


@pytest.mark.parametrize("taken", ["data", "sync"])
def test_a_taken_port_is_diagnosed(taken, capsys):
    data_port, sync_port = two_ports()
    port = data_port if taken == "data" else sync_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        argv = ["check-comm", "local", "--data-port", str(data_port), "--sync-port", str(sync_port)]
        assert main([*argv, "--megabytes", "1"]) != 0
    out = capsys.readouterr().out
    assert f"port {port} is already in use on this host" in out
    assert "--data-port/--sync-port" in out


def test_connect_where_nothing_listens(capsys):
    data_port, sync_port = two_ports()
    argv = ["check-comm", "connect", "--data-port", str(data_port), "--sync-port", str(sync_port)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    for port in (data_port, sync_port):
        assert f"nothing listens on 127.0.0.1:{port}: start `tandem check-comm serve`" in out
    assert "latency" not in out


def test_connect_to_a_live_trainer_sends_no_groups(capsys):
    data_port, sync_port = two_ports()
    context = zmq.Context()
    receiver = GroupReceiver(f"tcp://127.0.0.1:{data_port}", context=context)
    server = WeightServer(f"tcp://127.0.0.1:{sync_port}", run_id="live-run", context=context)
    try:
        server.publish(take_snapshot([("w", torch.ones(1000))], version=4, run_id="live-run"))
        report = check_connection(CheckSettings(data_port=data_port, sync_port=sync_port, num_groups=4))
        assert receiver.recv(timeout=0.3) is None  # no test group reached the trainer
    finally:
        server.close()
        receiver.close()
        context.term()
    assert report["passed"] and report["run_id"] == "live-run"
    assert "live trainer" in report["data_skipped"] and "data_num_groups" not in report
    assert report["sync_gb_per_s"] > 0 and report["latency_ms_median"] > 0
    assert "groups   skipped: run live-run is a live trainer" in capsys.readouterr().out


def test_connect_with_a_key_the_server_does_not_know_names_the_setting(tmp_path):
    keygen(tmp_path / "keys", ["trainer", "sampler"])
    keygen(tmp_path / "stranger", ["sampler"])
    data_port, sync_port = two_ports()
    serving = CurveConfig(
        server_secret_key=str(tmp_path / "keys/trainer.key_secret"),
        authorized_clients=str(tmp_path / "keys/authorized"),
    )
    connecting = CurveConfig(
        server_public_key=str(tmp_path / "keys/trainer.key"),
        client_secret_key=str(tmp_path / "stranger/sampler.key_secret"),
    )
    server = CheckServer("127.0.0.1", data_port, sync_port, 1, serving)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        settings = CheckSettings(data_port=data_port, sync_port=sync_port, megabytes=1, curve=connecting)
        report = check_connection(settings)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert not report["passed"] and len(report["problems"]) == 1
    assert "refused this sampler's CURVE key" in report["problems"][0]
    assert "pipeline.curve.client_secret_key" in report["problems"][0]
    assert server.num_groups == 0


def test_config_fills_what_the_flags_leave_out(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("pipeline:\n  trainer_host: 10.1.2.3\n  data_port: 6000\n  sync_port: 6001\n")
    args = build_parser().parse_args(
        ["check-comm", "connect", "--config", str(config), "--sync-port", "7001"]
    )
    settings = settings_from_args(args)
    assert (settings.trainer_host, settings.data_port, settings.sync_port) == ("10.1.2.3", 6000, 7001)
    assert not settings.curve.enabled
