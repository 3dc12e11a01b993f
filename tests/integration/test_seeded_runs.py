"""A seeded tiny run of every method, through the CLI, gives the same metric rows and the same final
parameters, bit for bit, as the recorded ones in `seeded_runs.json`: the guard of refactors that promise
no behaviour change (issue 16). One process per method, and 2-rank DDP runs whose batches need padding.

When a change *means* to change numbers (a new default, a fix), re-record and say so in the commit:
    TANDEM_RECORD_SEEDED_RUNS=1 .venv/bin/python -m pytest tests/integration/test_seeded_runs.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open
from test_distributed import torchrun

from tandem.cli import main

RECORD = Path(__file__).with_name("seeded_runs.json")
RECORDING = os.environ.get("TANDEM_RECORD_SEEDED_RUNS") == "1"
# fields that measure the machine (time, memory, throughput), not the maths
MACHINE_FIELDS = ("seconds", "memory", "per_second", "time", "throughput", "rss", "_mib", "_gb")

GRPO = [
    "sampling.dtype=float32",
    "sampling.max_new_tokens=8",
    "sampling.num_generations=4",
    "sampling.batch_size=8",
    "data.num_examples=20",
    "data.num_shots=0",
    "rewards=[{type: answer}, {type: format}, {type: function, function: 'tiny_rewards:digit_count'}]",
    "grpo.prompts_per_step=2",
    "grpo.kl_coef=0.04",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=4",
    "training.learning_rate=1e-3",
    "training.max_steps=3",
    "training.save_steps=2",
    "training.sample_log_steps=1",
    "pipeline.mode=colocated",
]
PPO = [
    "sampling.dtype=float32",
    "sampling.max_new_tokens=8",
    "sampling.num_generations=2",
    "sampling.batch_size=8",
    "data.num_examples=8",
    "data.num_shots=0",
    "rewards=[{type: answer}, {type: format}]",
    "grpo.prompts_per_step=4",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=4",
    "training.learning_rate=5e-3",
    "training.max_steps=3",
    "training.save_steps=2",
    "pipeline.mode=colocated",
]
SUPERVISED = [
    "data.num_examples=13",  # an uneven last batch
    "data.num_eval_examples=5",
    "data.num_shots=0",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=2",
    "training.learning_rate=1e-3",
    "training.max_steps=5",
    "training.num_epochs=100",
    "training.eval_steps=2",
    "training.save_steps=3",
]
LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj, up_proj]"]

# name: (command, ranks, overrides); 2-rank runs use DDP with gradient accumulation halved
CASES: dict[str, tuple[str, int, list[str]]] = {
    "grpo": ("grpo", 1, GRPO),
    "grpo_lora": ("grpo", 1, [*GRPO, *LORA, "training.learning_rate=1e-2"]),
    "grpo_ddp2": ("grpo", 2, GRPO),
    "ppo": ("ppo", 1, PPO),
    "ppo_ddp2": ("ppo", 2, PPO),
    "sft": ("sft", 1, [*SUPERVISED, "data.system_prompt=''"]),
    "sft_ddp2": ("sft", 2, [*SUPERVISED, "data.system_prompt=''"]),
    "rm": ("rm", 1, [*SUPERVISED, "rm.max_length=96"]),
    "dpo": ("dpo", 1, [*SUPERVISED, "dpo.beta=0.1"]),
    "dpo_ddp2": ("dpo", 2, [*SUPERVISED, "dpo.beta=0.1"]),
    "dpo_lora": ("dpo", 1, [*SUPERVISED, *LORA, "dpo.beta=0.1", "training.max_steps=2"]),
    "safe_mm_dpo": ("dpo", 1, [*SUPERVISED, "dpo.beta=0.1", "dpo.task=mixed", "training.max_steps=3"]),
}


def _overrides(name: str, tmp_path: Path, model_dir: Path, ranks: int, extra: list[str]) -> list[str]:
    args = [
        f"experiment_name={name}",
        f"output_dir={tmp_path}",
        "seed=3",
        f"model.policy={model_dir}",
        "training.device=cpu",
        *extra,
    ]
    if ranks == 2:
        accumulation = next(int(a.split("=")[1]) for a in extra if a.startswith("training.gradient_acc"))
        args += [
            "training.distributed_strategy=ddp",
            f"training.gradient_accumulation_steps={accumulation // 2}",
        ]
    return args


def _safe_mm(reward_model_dirs) -> list[str]:
    helpful, harmless = reward_model_dirs
    return [
        f"dpo.safe_mm.helpful_model={helpful}",
        f"dpo.safe_mm.harmless_model={harmless}",
        "dpo.safe_mm.variant=margin",  # the fixed-margin form this record was made with
        "dpo.safe_mm.helpful_weight=1.0",
        "dpo.safe_mm.harmless_weight=0.5",
        "dpo.safe_mm.safety_margin=0.3",
    ]


def fingerprint(run_dir: Path) -> dict:
    """The run's metric rows without machine-measured fields, and a SHA-256 of every final tensor."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if not any(m in k for m in MACHINE_FIELDS)})
    tensors = {}
    for path in sorted((run_dir / "final").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in sorted(f.keys()):
                data = f.get_tensor(key).contiguous().view(-1).view(dtype=__import__("torch").uint8)
                tensors[f"{path.name}:{key}"] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    assert tensors, f"no final tensors in {run_dir}"
    return {"rows": rows, "tensors": tensors}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_seeded_run_is_unchanged(name, tiny_model_dir, tmp_path, reward_model_dirs):
    command, ranks, extra = CASES[name]
    if name == "safe_mm_dpo":
        extra = [*extra, *_safe_mm(reward_model_dirs)]
    args = _overrides(name, tmp_path, tiny_model_dir, ranks, extra)
    if ranks == 1:
        assert main([command, *args]) == 0
    else:
        torchrun(ranks, "-m", "tandem.cli", command, *args)
    got = fingerprint(tmp_path / name)

    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if RECORDING:
        recorded[name] = got
        RECORD.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    assert name in recorded, f"no record of {name}: run with TANDEM_RECORD_SEEDED_RUNS=1 once"
    want = recorded[name]
    assert len(got["rows"]) == len(want["rows"])
    for step, (g, w) in enumerate(zip(got["rows"], want["rows"]), 1):
        assert g == w, f"{name}: row {step} differs: " + ", ".join(
            f"{k}: {w.get(k)!r} -> {g.get(k)!r}" for k in sorted(g.keys() | w.keys()) if g.get(k) != w.get(k)
        )
    changed = [k for k in want["tensors"] if got["tensors"].get(k) != want["tensors"][k]]
    assert got["tensors"].keys() == want["tensors"].keys() and not changed, (
        f"{name}: tensors differ: {changed}"
    )
