"""The decoupled pipeline as real processes on 127.0.0.1: `tandem train` + `tandem sample` (and
`tandem launch`) on a tiny random model, over real ZeroMQ sockets and real files."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

zmq = pytest.importorskip("zmq")

from tandem.transport.channel import free_tcp_port  # noqa: E402
from tandem.transport.wire import SCHEMA_VERSION, encode_control  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120


def env() -> dict:
    paths = [str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}


class Run:
    """One run folder and the processes that work on it."""

    def __init__(self, tmp_path: Path, model_dir: Path, name: str, *overrides: str) -> None:
        self.tmp, self.name = tmp_path, name
        self.dir = tmp_path / name
        self.data_port, self.sync_port = free_tcp_port(), free_tcp_port()
        self.overrides = [
            f"experiment_name={name}",
            f"output_dir={tmp_path}",
            "seed=3",
            f"model.policy={model_dir}",
            "sampling.dtype=float32",
            "sampling.max_new_tokens=8",
            "sampling.num_generations=4",
            "sampling.batch_size=8",
            "sampling.num_threads=1",
            "data.num_examples=40",
            "data.num_shots=0",
            "rewards=[{type: answer}, {type: format}, {type: function, function: 'tiny_rewards:digit_count'}]",
            "grpo.prompts_per_step=2",
            "grpo.skip_zero_variance_groups=false",
            "training.micro_batch_size=4",
            "training.gradient_accumulation_steps=2",
            "training.learning_rate=1e-3",
            "training.device=cpu",
            "training.num_threads=1",
            "training.max_steps=4",
            "training.save_steps=0",
            f"pipeline.data_port={self.data_port}",
            f"pipeline.sync_port={self.sync_port}",
            "pipeline.bind_host=127.0.0.1",
            "pipeline.data_timeout_s=90",
            "pipeline.trainer_timeout_s=90",
            *overrides,
        ]
        self.procs: list[subprocess.Popen] = []

    def start(self, command: str, *extra: str, log: str) -> subprocess.Popen:
        self.tmp.joinpath("logs").mkdir(exist_ok=True)
        out = (self.tmp / "logs" / f"{log}.log").open("ab")
        cmd = [sys.executable, "-m", "tandem.cli", command, *self.overrides, *extra]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT)
        out.close()
        self.procs.append(proc)
        return proc

    def trainer(self, *extra: str) -> subprocess.Popen:
        return self.start("train", *extra, log="trainer")

    def sampler(self, sampler_id: str = "s0", *extra: str) -> subprocess.Popen:
        return self.start("sample", "--sampler-id", sampler_id, "--device", "cpu", *extra, log=sampler_id)

    def log(self, name: str) -> str:
        return (self.tmp / "logs" / f"{name}.log").read_text(errors="replace")

    def wait(self, proc: subprocess.Popen, name: str, timeout: float = WAIT_S) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish in {timeout} s; its log:\n{self.log(name)[-3000:]}")

    def rows(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []

    def sampler_rows(self, sampler_id: str = "s0") -> list[dict]:
        path = self.dir / "samplers" / f"{sampler_id}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []

    def wait_for(self, predicate, what: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}")
            time.sleep(0.2)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def finish(run: Run, trainer, samplers: dict) -> None:
    assert run.wait(trainer, "trainer") == 0, run.log("trainer")[-3000:]
    for sid, proc in samplers.items():
        assert run.wait(proc, sid, timeout=60) == 0, run.log(sid)[-3000:]


def ready_samplers(run: Run, *sampler_ids: str) -> dict:
    """Start samplers and wait until each has loaded its models and looks for the trainer."""
    samplers = {sid: run.sampler(sid) for sid in sampler_ids}

    def ready(sid: str) -> bool:
        path = run.tmp / "logs" / f"{sid}.log"
        return path.is_file() and f"sampler {sid}: trainer" in path.read_text(errors="replace")

    run.wait_for(lambda: all(ready(sid) for sid in sampler_ids), "the samplers to start")
    return samplers


@pytest.mark.parametrize("sync_method", ["zmq", "fs"])
def test_sampler_and_trainer_processes_train_with_advancing_versions(make_run, sync_method):
    run = make_run(f"two_{sync_method}", f"pipeline.sync_method={sync_method}", "training.max_steps=5")
    trainer, sampler = run.trainer(), run.sampler()
    finish(run, trainer, {"s0": sampler})

    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # one-step off-policy (max_staleness 1): the groups of step k were made by version k-2 or k-1
    assert all(r["staleness_mean"] in (0.0, 1.0) for r in rows)
    assert [r["policy_version"] for r in rows][-1] >= 3
    assert sum(r["groups_dropped_stale"] for r in rows) == 0
    assert rows[-1]["groups_from_s0"] >= 10 and rows[-1]["messages_dropped"] == 0
    assert all(r["sync_seconds"] > 0 for r in rows)
    versions = [r["policy_version"] for r in run.sampler_rows()]
    assert versions == sorted(versions) and versions[-1] >= 3  # the sampler saw the new weights
    assert (run.dir / "final" / "model.safetensors").is_file()
    if sync_method == "fs":
        # pruned as it went (sync_keep_versions), and a finished run's versions are gone: only the
        # status that tells a late sampler the run is over remains
        assert sorted(p.name for p in (run.dir / "weights").iterdir()) == ["status.json"]
        status = json.loads((run.dir / "weights" / "status.json").read_text())
        assert status["finished"] is True and status["version"] == 5


def test_strictly_on_policy_ratio_is_one(make_run):
    """sync_every 1, max_staleness 0, one update per batch: the trainer's log-probs of every
    completion equal the sampler's old_policy_log_probs (fp32 on the CPU)."""
    run = make_run(
        "onpolicy",
        "pipeline.max_staleness=0",
        "pipeline.sync_every=1",
        "training.micro_batch_size=8",
        "training.gradient_accumulation_steps=1",
    )
    trainer, sampler = run.trainer(), run.sampler()
    finish(run, trainer, {"s0": sampler})
    rows = run.rows()
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3]
    assert all(r["staleness_mean"] == 0 and r["groups_dropped_stale"] == 0 for r in rows)
    assert all(r["ratio_abs_dev"] < 1e-5 for r in rows), [r["ratio_abs_dev"] for r in rows]
    # every group was made by the weights that take it: all its tokens are compared, and agree
    assert all(r["sampler_logprob_tokens"] == r["tokens_generated"] for r in rows)
    assert all(r["sampler_logprob_diff"] < 1e-5 for r in rows), [r["sampler_logprob_diff"] for r in rows]
    assert all(r["clip_fraction"] == 0 for r in rows)
    assert rows[-1]["grad_norm"] > 0
    # the sampler on this host was lent each version's shared snapshot file: no chunk was sent
    assert rows[-1]["weights_lent"] >= 3 and rows[-1]["weights_sent"] == 0, rows[-1]
    # each row carries the sampler's time split for the groups it trained on: here one sampler
    # batch per step, so exactly what the sampler recorded for that batch
    made = run.sampler_rows()
    for row, batch in zip(rows, made):
        for key in ("time_generate", "time_reference", "time_reward"):
            assert row[key] == pytest.approx(batch[key], rel=1e-9), key
    assert all(r["time_generate"] > 0 for r in rows)


def test_a_batch_spanning_two_versions_is_sampled_by_the_version_that_takes_it(make_run):
    """num_iterations 2, sync_every 1: each batch trains two steps, so versions 1, 3, 5 take no
    batch. A strictly on-policy sampler skips them (it paces by the trainer's announced schedule):
    nothing goes stale, and every batch was made by the weights that take it."""
    run = make_run("spans", "pipeline.max_staleness=0", "grpo.num_iterations=2", "training.max_steps=6")
    trainer, sampler = run.trainer(), run.sampler()
    finish(run, trainer, {"s0": sampler})
    rows = run.rows()
    assert [r["policy_version"] for r in rows] == [0, 0, 2, 2, 4, 4]
    assert sum(r["groups_dropped_stale"] for r in rows) == 0
    made = [(r["policy_version"], r["groups"]) for r in run.sampler_rows()]
    assert made[:3] == [(0, 2), (2, 2), (4, 2)], made  # (then version 6's, which no batch took)


def test_two_samplers_feed_one_trainer_and_surplus_is_dropped_as_stale(make_run):
    """Two samplers each told they are the only one (num_samplers=1) make twice what a strictly
    on-policy trainer can use: the surplus is dropped, counted, and training goes on."""
    run = make_run("fanin", "pipeline.max_staleness=0", "training.max_steps=4")
    samplers = ready_samplers(run, "s0", "s1")
    finish(run, run.trainer(), samplers)
    rows = run.rows()
    last = rows[-1]
    assert last["groups_from_s0"] > 0 and last["groups_from_s1"] > 0
    assert sum(r["groups_dropped_stale"] for r in rows) > 0
    assert all(r["staleness_mean"] == 0 for r in rows)


def test_two_samplers_share_the_work_and_every_group_is_accounted_for(make_run):
    """num_samplers=2: each makes half a version's groups. (Whether a few are dropped depends on
    timing: a sampler that starts late leaves the trainer starved and the other one makes more.)"""
    run = make_run("shared", "pipeline.num_samplers=2", "training.max_steps=4")
    samplers = ready_samplers(run, "s0", "s1")
    finish(run, run.trainer(), samplers)
    rows = run.rows()
    last = rows[-1]
    assert last["groups_from_s0"] > 0 and last["groups_from_s1"] > 0
    assert all(r["staleness_mean"] <= 1 for r in rows)
    used = 4 * 2  # steps x prompts_per_step
    dropped = sum(r["groups_dropped_stale"] + r["groups_dropped_future"] for r in rows)
    assert last["groups_from_s0"] + last["groups_from_s1"] == used + dropped


def test_sampler_killed_and_restarted_rejoins_with_the_latest_weights(make_run):
    # enough steps that the trainer still needs groups after the first sampler dies (a step of this
    # tiny model takes milliseconds: 10 steps could all be made before the kill lands)
    run = make_run("samplerkill", "training.max_steps=60")
    trainer, first = run.trainer(), run.sampler()
    run.wait_for(lambda: len(run.rows()) >= 3, "three trainer steps")
    first.kill()
    first.wait()
    killed_at = max(r["policy_version"] for r in run.sampler_rows())
    seen_before = len(run.sampler_rows())
    time.sleep(1.0)
    second = run.sampler()
    finish(run, trainer, {"s0": second})
    rejoined = run.sampler_rows()[seen_before:]
    assert rejoined and rejoined[0]["policy_version"] >= killed_at  # never back to old weights
    assert rejoined[0]["time_weights"] > 0  # it fetched before its first batch
    assert [r["step"] for r in run.rows()] == list(range(1, 61))
    assert "trainer finished" in run.log("s0")


def test_trainer_killed_and_restarted_resumes_and_the_sampler_reconnects(make_run):
    run = make_run("trainerkill", "training.max_steps=24", "training.save_steps=2")

    def checkpointed() -> list[int]:
        folder = run.dir / "checkpoints"
        return [int(p.name.split("-")[1]) for p in folder.glob("step-*")] if folder.is_dir() else []

    trainer, sampler = run.trainer(), run.sampler()
    run.wait_for(lambda: max(checkpointed(), default=0) >= 4, "a checkpoint at step 4 or later")
    trainer.kill()
    trainer.wait()
    assert len(run.rows()) < 24, "the trainer finished before it could be killed"
    resume_step = max(checkpointed())
    version_before = json.loads((run.dir / "sync_state.json").read_text())["version"]
    state = json.loads((run.dir / "checkpoints" / f"step-{resume_step}" / "trainer_state.json").read_text())
    checkpoint_version = state["experience"]["policy_version"]
    restarted = run.trainer("training.resume_from_checkpoint=latest")
    # a group made by weights published after the checkpoint, as a sampler could still have queued
    discarded = version_before if checkpoint_version < version_before else None
    if discarded is not None:
        from tandem.transport.channel import GroupSender
        from unit.test_admission import sound_group

        group = sound_group(policy_version=discarded)
        group.completions.append(group.completions[0])  # the run's G is 4
        # linger: delivered once the restarted trainer binds, however long its start takes
        with GroupSender(f"tcp://127.0.0.1:{run.data_port}", linger=WAIT_S) as sender:
            sender.send(group)
    finish(run, restarted, {"s0": sampler})
    rows = run.rows()
    # rows logged after the checkpoint were dropped on resume: every step appears once
    assert [r["step"] for r in rows] == list(range(1, 25))
    after = rows[resume_step:]
    # versions never repeat: the restarted trainer publishes after the last one it published
    assert max(r["policy_version"] for r in after) > version_before
    # and it trains on no group made by weights published after its checkpoint (its resume threw
    # those away): each such group is dropped as discarded, whatever its apparent staleness
    assert not [r["step"] for r in after if checkpoint_version < r["policy_version"] <= version_before]
    assert sum(r["groups_dropped_discarded"] for r in after) >= (discarded is not None)
    assert run.log("s0").count("trainer run ") == 2  # the same sampler process followed the new trainer


def test_hostile_messages_to_a_live_trainer_are_dropped_and_counted(make_run, tmp_path):
    run = make_run("fuzz", "training.max_steps=4", "pipeline.max_message_mb=1")
    trainer = run.trainer()
    # connect once the trainer listens (connecting first to a free ephemeral port can self-connect)
    run.wait_for(lambda: "waiting for samplers" in run.log("trainer"), "the trainer to bind")
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(f"tcp://127.0.0.1:{run.data_port}")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{run.sync_port}")
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    header = {"schema": SCHEMA_VERSION, "kind": "group", "arrays": [{"dtype": "float32", "shape": [2**40]}]}
    hostile = [
        [os.urandom(300)],
        [pickle.dumps(Exploit())],
        [json.dumps({**header, "schema": 999}).encode(), b"\x00" * 16],
        [json.dumps(header).encode(), b"\x00" * 16],  # a huge declared size, a tiny frame
        [b"{", b"truncated"],
        encode_control("stop", {}),
    ]
    for frames in hostile:
        push.send_multipart(frames)
        dealer.send_multipart(frames)  # the weight server gets the same garbage
    dealer.send(b"\x00" * 100_000)
    sampler = run.sampler()
    finish(run, trainer, {"s0": sampler})
    push.close()
    dealer.close()
    context.term()
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["messages_dropped"] == len(hostile)
    assert not marker.exists()
    assert "dropped" in run.log("trainer")


def test_well_formed_but_harmful_groups_are_rejected_by_reason_and_training_goes_on(make_run):
    """The hostile-peer report's single messages that each stopped a trainer, sent at the current
    policy version before the real sampler's groups: each is rejected with its reason, counted in
    the metrics, and the run trains its 4 steps; no sender-chosen id becomes a metrics key."""
    import dataclasses

    from tandem.transport.channel import GroupSender
    from unit.test_admission import HOSTILE

    G3 = ("sampling.num_generations=3", "training.micro_batch_size=3")  # the HOSTILE groups have 3
    run = make_run("semantic", "training.max_steps=4", *G3)
    trainer = run.trainer()
    run.wait_for(lambda: "waiting for samplers" in run.log("trainer"), "the trainer to bind")
    names = [
        "token id 2**31-1",
        "empty completions",
        "reward_info keys differ",
        "advantage 1e300",
        "sampler_id of 524,300 chars",
        "positive log-prob",
    ]
    with GroupSender(f"tcp://127.0.0.1:{run.data_port}") as sender:
        for name in names:
            group, _ = HOSTILE[name]
            sender.send(dataclasses.replace(group, policy_version=0))
        sampler = run.sampler()
        finish(run, trainer, {"s0": sampler})
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    last = rows[-1]
    assert last["groups_rejected"] == len(names)
    assert {k: v for k, v in last.items() if k.startswith("groups_rejected_")} == {
        "groups_rejected_group_size": 1,
        "groups_rejected_logprob": 1,
        "groups_rejected_non_finite": 1,
        "groups_rejected_reward_info": 1,
        "groups_rejected_sampler_id": 1,
        "groups_rejected_token_id": 1,
    }
    assert max(len(k) for row in rows for k in row) < 64
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in rows)


def test_curve_refuses_a_sampler_without_an_authorised_key(make_run, tmp_path):
    from tandem.transport.auth import keygen

    keys, stranger = tmp_path / "keys", tmp_path / "stranger"
    keygen(keys, ["trainer", "sampler"])
    keygen(stranger, ["sampler"])
    server = [
        f"pipeline.curve.server_secret_key={keys / 'trainer.key_secret'}",
        f"pipeline.curve.authorized_clients={keys / 'authorized'}",
    ]

    def client(folder):
        return [
            f"pipeline.curve.server_public_key={keys / 'trainer.key'}",
            f"pipeline.curve.client_secret_key={folder / 'sampler.key_secret'}",
        ]

    run = make_run("curve", "training.max_steps=3")
    trainer = run.start("train", *server, log="trainer")
    intruder = run.start(
        "sample", *client(stranger), "--sampler-id", "intruder", "--device", "cpu", log="intruder"
    )
    time.sleep(3.0)
    sampler = run.start("sample", *client(keys), "--sampler-id", "s0", "--device", "cpu", log="s0")
    finish(run, trainer, {"s0": sampler})
    intruder.kill()
    intruder.wait()
    rows = run.rows()
    assert rows[-1]["auth_refused"] > 0
    assert rows[-1]["groups_from_s0"] >= 6 and "groups_from_intruder" not in rows[-1]
    # both sides say so: the intruder which setting to fix, the trainer whom it refused
    assert "refused this sampler's CURVE key" in run.log("intruder")
    assert "tandem check-comm connect --trainer-host 127.0.0.1" in run.log("intruder")
    assert "does not answer" not in run.log("intruder")
    assert "refused a CURVE handshake from 127.0.0.1" in run.log("trainer")
    assert not run.sampler_rows("intruder") or all(
        r["groups_sent_total"] == 0 for r in run.sampler_rows("intruder")
    )


def test_grpo_runs_sampler_and_trainer_as_two_processes(make_run, tmp_path):
    run = make_run("grpo2")
    proc = run.start("grpo", log="grpo")
    assert run.wait(proc, "grpo") == 0, run.log("grpo")[-3000:]
    assert [r["step"] for r in run.rows()] == [1, 2, 3, 4]
    assert run.rows()[-1]["groups_from_s0"] >= 8
    assert (run.dir / "logs" / "sampler-s0.log").is_file()
    assert "final policy:" in run.log("grpo")


def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


@pytest.mark.parametrize("how", ["sampler_dies", "ctrl_c"])
def test_launch_stops_every_process(make_run, how):
    run = make_run(f"launch_{how}", "training.max_steps=1000")
    no_restarts = ("--max-sampler-restarts", "0")
    proc = run.start(
        "launch", "--sampling-devices", "cpu", "--training-devices", "cpu", *no_restarts, log="launch"
    )
    run.wait_for(lambda: len(run.rows()) >= 1, "a first step")
    children = _children(proc)
    assert len(children) == 2
    if how == "sampler_dies":
        sampler = next(c for c in children if "sample" in c.cmdline())
        sampler.kill()
        rc = run.wait(proc, "launch", timeout=60)
        assert rc != 0
        assert "sampler s0 was killed by signal 9; stopping the other processes" in run.log("launch")
    else:
        proc.send_signal(signal.SIGINT)
        rc = run.wait(proc, "launch", timeout=60)
        assert rc == 130, run.log("launch")[-3000:]
        assert "interrupted" in run.log("launch")
    assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)


def test_launch_brings_back_a_killed_sampler_and_a_killed_trainer(make_run):
    """kill -9 of the sampler, then of the trainer: the launcher starts each again (the trainer from
    its latest checkpoint), the run finishes, every step is recorded once and a final model is
    written; the restarts are in the launcher's log."""
    run = make_run("restarts", "training.max_steps=30", "training.save_steps=2")
    proc = run.start(
        "launch",
        "--sampling-devices",
        "cpu",
        "--training-devices",
        "cpu",
        "--max-restarts",
        "1",
        log="launch",
    )
    try:
        run.wait_for(lambda: len(run.rows()) >= 1, "a first step")
        sampler = next(c for c in _children(proc) if "sample" in c.cmdline())
        sampler.kill()
        run.wait_for(
            lambda: "sampler s0 was killed by signal 9; starting it again" in run.log("launch"), "the restart"
        )
        run.wait_for(lambda: len(run.rows()) >= 5, "step 5")  # checkpoints at steps 2 and 4
        trainer = next(c for c in _children(proc) if " train " in " ".join(c.cmdline()))
        trainer.kill()
        assert run.wait(proc, "launch", timeout=WAIT_S) == 0, run.log("launch")[-3000:]
    finally:
        run.kill_all()
    text = run.log("launch")
    assert "trainer was killed by signal 9; starting it again in 1 s (restart 1 of 1)" in text
    assert "started trainer again (restart 1)" in text and "started sampler s0 again (restart 1)" in text
    assert [r["step"] for r in run.rows()] == list(range(1, 31))
    assert (run.dir / "final" / "config.json").is_file()


def test_a_taken_port_stops_the_trainer_with_a_clear_error(make_run):
    import socket

    run = make_run("taken")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", run.data_port))
        holder.listen()
        rc = run.wait(run.trainer(), "trainer", timeout=60)
    assert rc == 2
    assert f"port {run.data_port}" in run.log("trainer") or "already in use" in run.log("trainer")
    assert "Traceback" not in run.log("trainer")


def test_a_reward_function_that_raises_stops_the_run_loudly(make_run):
    """A bug in a user's reward: the sampler logs its traceback and exits with RewardError's code, and
    the launcher stops the run at once (no restarts: each would meet the same bug), showing why."""
    run = make_run("broken_reward", "rewards=[{type: function, function: 'tiny_rewards:broken'}]")
    proc = run.start("grpo", log="grpo")
    assert run.wait(proc, "grpo") == 4, run.log("grpo")[-3000:]
    sampler_log = (run.dir / "logs" / "sampler-s0.log").read_text()
    message = "reward 'broken' (tiny_rewards:broken) raised ZeroDivisionError: division by zero at "
    assert message in sampler_log and "tiny_rewards.py" in sampler_log
    assert "Traceback" in sampler_log  # the user's own frames, in the sampler's log
    text = run.log("grpo")
    assert "sampler s0 exited with code 4; stopping the other processes" in text and message in text
    assert "starting it again" not in text


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_dynamic_sampling_with_two_samplers_sends_informative_groups_and_paces(make_run, max_staleness):
    """grpo.dynamic_sampling with num_samplers=2: each sampler drops the flat groups it makes and
    replaces them, pacing counts only the groups sent (strictly on-policy too, where a sampler never
    makes a surplus), and trainer and samplers agree on the counts."""
    run = make_run(
        f"dynamic2_{max_staleness}",
        "pipeline.num_samplers=2",
        f"pipeline.max_staleness={max_staleness}",
        "rewards=[{type: function, function: 'tiny_rewards:half_informative'}]",
        "grpo.dynamic_sampling=true",
        "grpo.dynamic_sampling_max_extra_prompts=40",
        "training.max_steps=4",
    )
    samplers = ready_samplers(run, "s0", "s1")
    finish(run, run.trainer(), samplers)
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["zero_variance_groups"] == 0 for r in rows)
    assert all(r["staleness_mean"] <= max_staleness for r in rows)
    sent = {sid: sum(r["groups"] for r in run.sampler_rows(sid)) for sid in ("s0", "s1")}
    for sid in ("s0", "s1"):
        srows = run.sampler_rows(sid)
        assert all(r["groups_generated"] == r["groups"] + r["groups_filtered"] for r in srows)
        # groups a sampler made for the trainer's last batches may still be queued when it finishes
        assert 0 < rows[-1][f"groups_from_{sid}"] <= sent[sid]
    dropped = sum(r["groups_dropped_stale"] + r["groups_dropped_future"] for r in rows)
    received = rows[-1]["groups_from_s0"] + rows[-1]["groups_from_s1"]
    assert received == 4 * 2 + dropped  # every group received trained on or counted as dropped
    filtered_by_samplers = sum(r["groups_filtered"] for sid in ("s0", "s1") for r in run.sampler_rows(sid))
    # the trainer's count is what the groups it took carry: at most what the samplers dropped
    assert 0 < sum(r["groups_filtered"] for r in rows) <= filtered_by_samplers
