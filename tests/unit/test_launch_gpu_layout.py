"""`tandem launch` on GPUs, checked on the CPU: the seed's layout (a sampler on GPU 0, two trainer
ranks on 1,2) as command lines and environments, under torchrun and the deepspeed launcher, with
and without an inherited CUDA_VISIBLE_DEVICES; and `--dry-run` through the real command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.config import ConfigError, load_config
from tandem.launch import CVD, Nodes, child_environ, command_line, parse_devices, plan

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "grpo_tiny.yaml"
# the launcher's own environment: none, or one that a SLURM job (or a container) set
INHERITED = {"no inherited CVD": None, "inherited CVD=4,5,6": "4,5,6"}
# what the seed's indices 0 | 1,2 are as physical GPUs, in each of those environments
PHYSICAL = {None: ("0", "1,2"), "4,5,6": ("4", "5,6")}


def launcher_environ(inherited: str | None) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k != CVD}
    return environ if inherited is None else {**environ, CVD: inherited}


def seed_layout(launcher: str, environ: dict[str, str], port: int = 29500):
    cfg = load_config(CONFIG, [])
    return plan(
        str(CONFIG), [], cfg, ["0"], ["1", "2"], Nodes(master_port=port, launcher=launcher), environ=environ
    )


def assert_sampler_sees(sampler, environ: dict[str, str], gpu: str) -> None:
    assert sampler.name == "sampler s0" and sampler.cmd[1:4] == ["-m", "tandem.cli", "sample"]
    assert sampler.cmd[-2:] == ["--device", "cuda:0"]  # its one GPU, whatever its number
    assert sampler.env == {CVD: gpu, "TANDEM_LAUNCHED": "1"} and sampler.unset == []
    assert child_environ(sampler, environ)[CVD] == gpu and sampler.gpus == gpu
    assert command_line(sampler) == sampler.cmd


@pytest.mark.parametrize("inherited", INHERITED.values(), ids=INHERITED.keys())
def test_seed_layout_under_torchrun(inherited):
    environ = launcher_environ(inherited)
    sampler_gpu, trainer_gpus = PHYSICAL[inherited]
    trainer, sampler = seed_layout("torchrun", environ)

    assert trainer.cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in trainer.cmd and "--nnodes=1" in trainer.cmd
    tail = trainer.cmd[trainer.cmd.index("tandem.cli") :]
    assert tail[:3] == ["tandem.cli", "train", str(CONFIG)]
    assert "training.device=cuda" in tail and "training.distributed_strategy=auto" in tail
    # torchrun hands its environment to the ranks as it is: both see exactly GPUs 1,2 (or 5,6)
    assert trainer.env == {CVD: trainer_gpus, "TANDEM_LAUNCHED": "1"} and trainer.unset == []
    assert child_environ(trainer, environ)[CVD] == trainer_gpus == trainer.gpus
    assert command_line(trainer) == trainer.cmd
    assert_sampler_sees(sampler, environ, sampler_gpu)


@pytest.mark.parametrize("inherited", INHERITED.values(), ids=INHERITED.keys())
def test_seed_layout_under_the_deepspeed_launcher(inherited):
    environ = launcher_environ(inherited)
    sampler_gpu, trainer_gpus = PHYSICAL[inherited]
    trainer, sampler = seed_layout("deepspeed", environ)

    assert trainer.cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    # --num_gpus=2 would make the runner drop CUDA_VISIBLE_DEVICES and take GPUs 0,1 (the sampler's)
    assert f"--include=localhost:{trainer_gpus}" in trainer.cmd
    assert not any(arg.startswith(("--num_gpus", "--num_accelerators", "--num_nodes")) for arg in trainer.cmd)
    assert trainer.cmd[trainer.cmd.index("tandem.cli") - 2 :][:4] == [
        "--no_local_rank",
        "--module",
        "tandem.cli",
        "train",
    ]
    assert "training.device=cuda" in trainer.cmd
    # nothing in the runner's environment contradicts --include: an inherited CVD is removed
    assert trainer.env == {"TANDEM_LAUNCHED": "1"} and trainer.unset == [CVD]
    assert CVD not in child_environ(trainer, environ) and trainer.gpus == trainer_gpus
    assert command_line(trainer) == [sys.executable, "-m", "tandem.launch", "--keep-group", *trainer.cmd]
    assert_sampler_sees(sampler, environ, sampler_gpu)


PROBE = """import json, os, pathlib
seen = {"rank": os.environ["RANK"], "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}
pathlib.Path(os.environ["PROBE_DIR"], "rank-" + seen["rank"] + ".json").write_text(json.dumps(seen))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
@pytest.mark.parametrize("inherited", INHERITED.values(), ids=INHERITED.keys())
def test_the_real_launcher_gives_each_rank_its_gpus(tmp_path, launcher, inherited):
    """The trainer's command and environment as `Launcher.start` runs them, with only the module the
    ranks run swapped for one that writes down what each rank sees: torchrun's ranks, and the deepspeed
    runner's (which rewrites CUDA_VISIBLE_DEVICES), see exactly the trainer's GPUs."""
    if launcher == "deepspeed":
        pytest.importorskip("deepspeed")
    environ = launcher_environ(inherited)
    _, trainer_gpus = PHYSICAL[inherited]
    trainer, _ = seed_layout(launcher, environ, port=free_port())
    cmd = command_line(trainer)
    cmd = [*cmd[: cmd.index("tandem.cli")], "tandem_probe"]  # the ranks' module, nothing else
    (tmp_path / "tandem_probe.py").write_text(PROBE)
    env = child_environ(trainer, environ)
    env |= {
        "PYTHONPATH": os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]),
        "PROBE_DIR": str(tmp_path),
    }
    # no GPU here: the runner counts its slots with DeepSpeed's CPU accelerator, which sets each
    # rank's CUDA_VISIBLE_DEVICES as the CUDA one does; LOCAL_SIZE=8 gives it 8 slots, as 8 GPUs
    env |= {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "8"} if launcher == "deepspeed" else {}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank-*.json"))]
    assert seen == [
        {"rank": "0", "cvd": trainer_gpus},
        {"rank": "1", "cvd": trainer_gpus},
    ]


def test_indices_count_within_the_inherited_list_and_uuids_pass_through():
    cfg = load_config(CONFIG, [])
    environ = launcher_environ("GPU-aaa,GPU-bbb,GPU-ccc")
    trainer, sampler = plan(None, [], cfg, ["0"], ["1", "2"], Nodes(), environ=environ)
    assert trainer.env[CVD] == "GPU-bbb,GPU-ccc" and sampler.env[CVD] == "GPU-aaa"

    assert parse_devices("MIG-1f2e, 3", "--sampling-devices") == ["MIG-1f2e", "3"]
    children = plan(
        None, [], cfg, ["MIG-1f2e", "3"], ["GPU-9a"], Nodes(), environ=launcher_environ("4,5,6,7")
    )
    assert [c.env[CVD] for c in children] == ["GPU-9a", "MIG-1f2e", "7"]
    with pytest.raises(ConfigError, match="each device is `cpu`, a GPU index"):
        parse_devices("gpu1", "--training-devices")


def test_an_index_beyond_the_inherited_list_names_the_list():
    cfg = load_config(CONFIG, [])
    with pytest.raises(
        ConfigError,
        match=r"--training-devices: GPU 3 is not in the inherited CUDA_VISIBLE_DEVICES=4,5,6 \(3 GPU",
    ):
        plan(None, [], cfg, ["0"], ["1", "3"], Nodes(), environ=launcher_environ("4,5,6"))
    with pytest.raises(
        ConfigError, match="--sampling-devices: GPU 0 is not in the inherited CUDA_VISIBLE_DEVICES= .no GPU"
    ):
        plan(None, [], cfg, ["0"], ["cpu"], Nodes(), environ=launcher_environ(""))
    # without an inherited list the indices are the machine's own
    trainer, _ = plan(None, [], cfg, ["0"], ["6", "7"], Nodes(), environ=launcher_environ(None))
    assert trainer.env[CVD] == "6,7"


def test_the_deepspeed_launcher_takes_indices_on_one_node():
    cfg = load_config(CONFIG, [])
    with pytest.raises(ConfigError, match="picks GPUs by index.*GPU-bbb.*--launcher torchrun"):
        plan(
            None,
            [],
            cfg,
            ["0"],
            ["1", "2"],
            Nodes(launcher="deepspeed"),
            environ=launcher_environ("GPU-aaa,GPU-bbb,GPU-ccc"),
        )
    with pytest.raises(ConfigError, match="--nnodes 2.*use --launcher torchrun"):
        plan(None, [], cfg, ["0"], ["1", "2"], Nodes(nnodes=2, launcher="deepspeed"), environ={})
    # one GPU rank is no distributed job: a plain trainer process, whichever launcher is named
    (trainer, _) = plan(
        None, [], cfg, ["0"], ["2"], Nodes(launcher="deepspeed"), environ=launcher_environ("4,5,6")
    )
    assert trainer.cmd[1:4] == ["-m", "tandem.cli", "train"] and trainer.env[CVD] == "6"
    # CPU ranks: a count of slots (the runner's CPU accelerator has one per NUMA node), as before
    (trainer, _) = plan(None, [], cfg, ["cpu"], ["cpu", "cpu"], Nodes(launcher="deepspeed"), environ={})
    assert "--num_gpus=2" in trainer.cmd and trainer.env["DS_ACCELERATOR"] == "cpu" and trainer.gpus is None


def run_cli(args: list[str], cwd: Path, inherited: str | None) -> subprocess.CompletedProcess:
    env = launcher_environ(inherited)
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("inherited", INHERITED.values(), ids=INHERITED.keys())
def test_dry_run_prints_the_gpu_plan_and_starts_nothing(tmp_path, inherited):
    """The real command on this CPU machine: every child's block, exit 0, the machine's lack of CUDA
    said rather than refused, and no run folder (Launcher.start makes its logs/ before any child)."""
    args = [str(CONFIG), "--sampling-devices", "0", "--training-devices", "1,2", "--dry-run"]
    out = run_cli(["launch", *args], tmp_path, inherited)
    assert out.returncode == 0, out.stderr
    sampler_gpu, trainer_gpus = PHYSICAL[inherited]
    text = out.stdout
    assert "2 process(es) on this node; none is started" in text
    trainer_block, sampler_block = text.split("\n\ntrainer: ")[1], text.split("\n\nsampler s0: ")[1]
    assert trainer_block.startswith(f"2 ranks under torchrun, each rank sees {CVD}={trainer_gpus}")
    assert f"  set    {CVD}={trainer_gpus}" in trainer_block and "  set    TANDEM_LAUNCHED=1" in trainer_block
    run_line = next(line for line in trainer_block.splitlines() if line.startswith("  run "))
    assert "-m torch.distributed.run --nproc-per-node=2" in run_line and "training.device=cuda" in run_line
    assert sampler_block.startswith(f"1 process, sees {CVD}={sampler_gpu}")
    assert f"  set    {CVD}={sampler_gpu}" in sampler_block and "--device cuda:0" in sampler_block
    assert "output runs/grpo_tiny/logs/sampler-s0.log" in sampler_block
    if inherited is not None:
        assert f"inherited {CVD}={inherited}" in text and f"(inherited: {inherited})" in sampler_block
    if not has_cuda():
        assert "note: this machine has no CUDA device torch can use" in text
    assert "run folder runs/grpo_tiny: not created" in text
    assert list(tmp_path.iterdir()) == []  # nothing written: no run folder, no sampler log


def test_dry_run_with_the_deepspeed_launcher_through_the_cli(tmp_path):
    args = [str(CONFIG), "--sampling-devices", "0", "--training-devices", "1,2", "--launcher", "deepspeed"]
    out = run_cli(["launch", *args, "--dry-run"], tmp_path, "4,5,6")
    assert out.returncode == 0, out.stderr
    trainer_block = out.stdout.split("\n\ntrainer: ")[1].split("\n\n")[0]
    assert f"gives each {CVD}=5,6 (--include)" in trainer_block
    assert f"  unset  {CVD}  (inherited: 4,5,6)" in trainer_block and f"  set    {CVD}" not in trainer_block
    assert "--keep-group" in trainer_block and "--include=localhost:5,6" in trainer_block
    assert "--num_gpus" not in trainer_block
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(has_cuda(), reason="this machine has CUDA: the launch would start")
def test_a_real_launch_on_gpus_this_machine_lacks_is_refused_before_the_run_folder(tmp_path):
    out = run_cli(
        ["launch", str(CONFIG), "--sampling-devices", "0", "--training-devices", "1,2"], tmp_path, None
    )
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and "--dry-run prints the plan" in out.stderr
    assert list(tmp_path.iterdir()) == []
