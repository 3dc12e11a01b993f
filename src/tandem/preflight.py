"""Preflight: the mistakes a run's config can hold, named before any model loads.

Every CLI command calls `check_run(cfg, command)` right after loading its config: each path it
names (data, models, reward models, checkpoints, DeepSpeed and CURVE files), hub ids (one short
probe, never transformers' retries), reward functions, optional packages and the device. A failure
is a one-line ConfigError naming the key and the fix. Nothing here loads a model; a sampler's local
prompt file is read and checked row by row (a bad row is named before any model loads); hub data
sets are only probed.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from tandem.config import Config, ConfigError, CurveConfig, TrainingConfig
from tandem.data import gsm8k
from tandem.data.files import is_saved_dataset
from tandem.models import loading

COMMANDS = ("grpo", "ppo", "train", "sample", "launch", "sft", "rm", "dpo")
# what each data loader accepts (data/gsm8k.py load_examples, data/sft.py, data/preferences.py)
DATA_FORMS = {
    "prompts": "synthetic, gsm8k (openai/gsm8k from the hub), a .jsonl/.json/.csv/.parquet file with a "
    "prompt column (or GSM8K's question/answer), a folder saved by `datasets` or holding SPLIT.jsonl, "
    "or a hub data set id (org/name)",
    "sft": "synthetic, gsm8k, a .jsonl/.parquet file, or a hub data set id (org/name)",
    "preferences": "synthetic, a .jsonl/.parquet file, or a hub data set id (org/name)",
}
DATA_NAMES = ("synthetic", "gsm8k")


def check_run(cfg: Config, command: str, *, probe: bool = True) -> None:
    """Everything `tandem COMMAND` will need from `cfg`, checked on this machine; raises ConfigError.

    `command` is the CLI's (grpo, ppo, train, sample, launch, sft, rm, dpo): it decides which side
    runs here. The trainer side (all but `sample`) needs the device, checkpoints, DeepSpeed files
    and reporters; the sampler side (grpo, ppo, sample, and launch of a grpo/ppo config) needs the
    prompts, reward functions and reward models. Hub ids are probed last, after every local check;
    `probe=False` leaves them to the loaders (a process a launcher started, whose parent probed)."""
    if command not in COMMANDS:
        raise ValueError(f"check_run: unknown command {command!r}; one of {COMMANDS}")
    trainer = command != "sample"
    sampler = cfg.method in ("grpo", "ppo") and command in ("grpo", "ppo", "sample", "launch")
    probes: dict[str, Callable[[], None]] = {}  # one request per hub id, after the local checks

    if trainer:
        check_device(cfg.training.device)
    _check_models(cfg, trainer=trainer, sampler=sampler, probes=probes)
    _check_data(cfg, trainer=trainer, sampler=sampler, probes=probes)
    if sampler:
        _check_rewards(cfg)
    if trainer:
        _check_training_files(cfg)
    decoupled = cfg.method in ("grpo", "ppo") and (
        command in ("train", "sample", "launch") or cfg.pipeline.mode == "decoupled"
    )
    if decoupled:
        _check_curve(cfg.pipeline.curve, trainer=trainer, sampler=sampler)
    _check_packages(cfg, trainer=trainer)
    if probe:
        for ask_hub in probes.values():
            ask_hub()


# --------------------------------------------------------------------------- devices


def check_device(spec: str, key: str = "training.device") -> None:
    """`cuda` / `cuda:N` only where torch sees that device; `auto` and `cpu` always pass."""
    match = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if match is None:
        return  # auto, cpu (anything else: config.validate names it)
    import torch

    assign = _setting(key, "")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"`{key}` is {spec} but torch.cuda.is_available() is False ({_torch_build(torch)}): "
            f"set {assign}cpu or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if match.group(1) is not None and int(match.group(1)) >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f", CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""
        raise ConfigError(
            f"`{key}` is {spec} but torch sees {count} CUDA device(s) (cuda:0..cuda:{count - 1}{shown}): "
            f"set {assign}cuda:0 (or another index below {count})"
        )


def _setting(key: str, value: str) -> str:
    """How the user sets `key`: `--flag value` on the command line, `a.b=value` in a config."""
    return f"{key} {value}" if key.startswith("--") else f"{key}={value}"


def _torch_build(torch) -> str:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__}, a CPU build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"torch {torch.__version__}, a GPU build, but no GPU is visible{shown}"


# --------------------------------------------------------------------------- models


def _check_models(cfg: Config, *, trainer: bool, sampler: bool, probes: dict) -> None:
    """model.policy and model.tokenizer everywhere; model.reference where it is loaded (the
    sampler of grpo/ppo, the dpo trainer); reward models of the sampler and of Safe-MM-DPO."""
    specs = [("model.policy", cfg.model.policy), ("model.tokenizer", cfg.model.tokenizer)]
    if sampler or (trainer and cfg.method == "dpo"):
        specs.append(("model.reference", cfg.model.reference))
    for key, spec in specs:
        if spec is not None and loading.check_model_spec(spec, key, probe=False) == "hub":
            probes.setdefault(spec, lambda spec=spec, key=key: loading.raise_for_hub(spec, key))
    if sampler:
        for i, reward in enumerate(cfg.rewards):
            if reward.type == "model" and reward.path:
                _check_reward_model(
                    reward.path, f"rewards[{i}].path", "give the final/ folder of a `tandem rm` run"
                )
    if trainer and cfg.method == "dpo":
        for task in ("helpful", "harmless"):
            path = getattr(cfg.dpo.safe_mm, f"{task}_model")
            if path is not None:
                fix = f"train it first with `tandem rm configs/rm_{task}.yaml` and give its final/ folder"
                _check_reward_model(path, f"dpo.safe_mm.{task}_model", fix)


def _check_reward_model(path: str, key: str, fix: str) -> None:
    """A reward model is always a local `tandem rm` folder (rewards/model.py, trainer/dpo.py)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        hint = loading.did_you_mean(path, models=True)
        raise ConfigError(f"`{key}`: {path} does not exist{hint}; {fix}")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"`{key}`: {path} is not a model folder (no config.json); {fix}")


# --------------------------------------------------------------------------- data


def _check_data(cfg: Config, *, trainer: bool, sampler: bool, probes: dict) -> None:
    """The prompts of grpo/ppo samplers; the training and held-out sets of sft, rm and dpo."""
    d = cfg.data
    sources = []
    if sampler:
        sources.append(("data.dataset", d.dataset, "prompts", d.split))
    evaluates = (
        cfg.method in ("grpo", "ppo") and cfg.eval.steps > 0 and (sampler or cfg.pipeline.mode == "colocated")
    )
    if evaluates:
        if cfg.eval.dataset is None and Path(d.dataset).expanduser().is_file():
            raise ConfigError(
                f"`eval.dataset` is unset and data.dataset {d.dataset} is one file, which has no held-out "
                "split: give eval.dataset (a file of held-out prompts), or set eval.steps=0"
            )
        sources.append(("eval.dataset", cfg.eval.dataset or d.dataset, "prompts", cfg.eval.split))
    elif trainer and cfg.method in ("sft", "rm", "dpo"):
        use = "sft" if cfg.method == "sft" else "preferences"
        sources.append(("data.dataset", d.dataset, use, d.split))
        if d.eval_dataset is not None and d.num_eval_examples > 0:
            sources.append(("data.eval_dataset", d.eval_dataset, use, "test"))
    for key, source, use, split in sources:
        kind = check_dataset(source, key, use=use, split=split, probe=False)
        if kind == "hub":
            repo = _hub_repo(source)
            probes.setdefault(f"data:{repo}", lambda repo=repo, key=key: _probe_data(repo, key))
        elif use == "prompts" and kind in ("file", "folder"):
            check_prompt_rows(cfg, key, source, split)


def check_prompt_rows(cfg: Config, key: str, source: str, split: str) -> None:
    """Read a local prompt set the way the sampler will (data/prompt_sets.py) and check the prompt
    format settings against it: a bad row is named (file:line, the column) before any model loads."""
    from tandem.data.prompt_sets import load_examples
    from tandem.data.prompts import prompt_style

    d = cfg.data
    try:
        load_examples(
            source, split, d.num_examples, cfg.seed, difficulty=d.difficulty, prompt_column=d.prompt_column
        )
        prompt_style(d, from_question=True)
        prompt_style(d, from_question=False)
    except ValueError as err:
        raise ConfigError(f"`{key}`: {err}") from None


def check_dataset(
    source: str,
    key: str = "data.dataset",
    *,
    use: str = "prompts",
    split: str = "train",
    split_key: str = "data.split",
    probe: bool = True,
) -> str:
    """Say what data `source` names for a loader of `use` (prompts: GRPO/PPO samplers and `tandem
    eval`; sft; preferences: rm and dpo), or raise ConfigError naming `key` and the fix:
    "synthetic", "file", "folder", "hub-cached" or "hub". Local-looking sources that do not exist are
    refused with the closest existing path; a hub data set needs `datasets` and, unless cached, is
    looked up once (`probe`)."""
    if source == "synthetic":
        return "synthetic"
    path = Path(source).expanduser()
    if path.is_file():
        _check_data_file(path, source, key)
        return "file"
    if path.is_dir():
        _check_data_folder(path, source, key, use=use, split=split, split_key=split_key)
        return "folder"
    if not (source in gsm8k.HUB_IDS and use in ("prompts", "sft")):
        _refuse_missing_data(source, key, use)
    return _check_hub_data(source, key, probe=probe)


def _refuse_missing_data(source: str, key: str, use: str) -> None:
    """`source` is neither a local file/folder nor a hub id this loader takes: say which."""
    first, slash, _ = source.partition("/")
    looks_local = (
        not loading.is_hub_id(source)
        or (slash and Path(first).exists())
        or bool(loading.did_you_mean(source, only_close=True))
    )
    if looks_local:
        hint = loading.did_you_mean(source)
        raise ConfigError(f"`{key}`: {source} does not exist{hint}")
    forms = DATA_FORMS[use]
    if use == "preferences" and source in gsm8k.HUB_IDS:
        raise ConfigError(f"`{key}` is {source}, which has no preference pairs; it takes {forms}")
    names = DATA_NAMES if use != "preferences" else ("synthetic",)
    close = difflib.get_close_matches(source, names, n=1, cutoff=0.6)
    if close:
        raise ConfigError(f"`{key}` is {source!r}: did you mean {close[0]}? It takes {forms}")
    if "/" not in source:
        raise ConfigError(f"`{key}` is {source!r}, which is not a data source; it takes {forms}")


def _hub_repo(source: str) -> str:
    return "openai/gsm8k" if source in gsm8k.HUB_IDS else source


def _check_hub_data(source: str, key: str, *, probe: bool) -> str:
    repo = _hub_repo(source)
    if importlib.util.find_spec("datasets") is None:
        what = f"loads {repo} from the hub" if repo != source else "is a hub data set"
        raise ConfigError(
            f"`{key}`: {source} {what}, which needs the `datasets` package: pip install 'tandem[hub]'; "
            f"or give a local copy ({_setting(key, 'path/to/data.jsonl')})"
        )
    if _in_dataset_cache(repo):
        return "hub-cached"
    if loading.hub_offline(datasets=True):
        raise ConfigError(
            f"`{key}`: {source} loads {repo} from the hub, but it is not in the local cache and offline "
            f"mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): give a local copy ({_setting(key, 'path/to/data.jsonl')})"
        )
    if probe:
        _probe_data(repo, key)
    return "hub"


def _probe_data(repo: str, key: str) -> None:
    loading.raise_for_hub(repo, key, what="data set")


def _in_dataset_cache(repo: str) -> bool:
    """A hub download of `repo`, or the `datasets` library's own prepared copy of it."""
    if loading.in_hub_cache(repo, repo_type="dataset", filename="*"):
        return True
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or Path(home) / "datasets").expanduser()
    return (datasets_cache / repo.replace("/", "___")).is_dir()


def _check_data_file(path: Path, source: str, key: str) -> None:
    """What data/files.py can read: .parquet (with pyarrow or pandas), else JSON lines."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        if importlib.util.find_spec("pyarrow") is None and importlib.util.find_spec("pandas") is None:
            raise ConfigError(f"`{key}`: reading {source} (.parquet) needs pyarrow: pip install pyarrow")
        return
    with path.open("rb") as f:
        head = f.read(65536).lstrip()
    if not head:
        raise ConfigError(f"`{key}`: {source} is empty; give a .jsonl file with one JSON object per line")
    if suffix in (".csv", ".tsv"):
        return
    if head[:1] == b"[" and suffix == ".json":
        return
    if head[:1] == b"[":
        raise ConfigError(
            f"`{key}`: {source} holds a JSON array; name it .json (an array of objects) or write JSON "
            "lines (one object per line), e.g. jq -c '.[]' in.json > out.jsonl"
        )
    if head[:1] != b"{":
        raise ConfigError(
            f"`{key}`: {source} is not JSON lines (it starts with {head[:12]!r}); give a .jsonl file "
            "with one JSON object per line, or a .parquet file"
        )


def _check_data_folder(path: Path, source: str, key: str, *, use: str, split: str, split_key: str) -> None:
    """Only prompts (data/prompt_sets.py) read folders: saved by `datasets`, or SPLIT.jsonl,
    SPLIT.parquet or SPLIT-*.parquet."""
    if use == "prompts" and is_saved_dataset(path):
        if importlib.util.find_spec("datasets") is None:
            raise ConfigError(
                f"`{key}`: {source} was saved by `datasets`; reading it needs it: pip install datasets"
            )
        return
    files = sorted(
        p for folder in (path, path / "main") for p in folder.glob("*") if p.suffix in (".jsonl", ".parquet")
    )
    if use != "prompts":
        inside = f" (it holds {', '.join(str(p) for p in files[:3])})" if files else ""
        who = "SFT" if use == "sft" else "rm and dpo"
        raise ConfigError(f"`{key}`: {source} is a folder; {who} read one .jsonl/.parquet file{inside}")
    try:
        found = gsm8k.files_for(source, split)
    except ValueError:
        splits = sorted({p.name.split(".")[0].split("-")[0] for p in files})
        fix = (
            f"set {_setting(split_key, splits[0])} (it holds: {', '.join(p.name for p in files[:4])})"
            if splits
            else "give a .jsonl/.parquet file or a folder holding SPLIT.jsonl"
        )
        raise ConfigError(
            f"`{key}`: {source} has no {split}.jsonl, {split}.parquet or {split}-*.parquet; {fix}"
        ) from None
    for file in found:
        _check_data_file(file, str(file), key)


# --------------------------------------------------------------------------- rewards


def _check_rewards(cfg: Config) -> None:
    """Each `type: function` reward imports here, its factory (with `kwargs`) builds it, and it can be
    called one of the two ways (rewards/calling.py); what is wrong is a ConfigError naming rewards[i]."""
    from tandem.rewards.registry import resolve_function

    for i, spec in enumerate(cfg.rewards):
        if spec.type == "function" and spec.function:
            resolve_function(spec, f"rewards[{i}]")


# --------------------------------------------------------------------------- trainer files


def _check_training_files(cfg: Config) -> None:
    tc = cfg.training
    resume = tc.resume_from_checkpoint
    if resume is not None and resume != "latest":
        _check_resume(resume)
    if tc.deepspeed_config is not None and tc.distributed_strategy in ("deepspeed", "auto"):
        path = Path(tc.deepspeed_config).expanduser()
        if not path.is_file():
            hint = loading.did_you_mean(tc.deepspeed_config)
            raise ConfigError(
                f"`training.deepspeed_config`: {tc.deepspeed_config} does not exist{hint}; "
                "give a DeepSpeed JSON such as configs/deepspeed/zero2.json"
            )
        try:
            json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"`training.deepspeed_config`: {tc.deepspeed_config} is not valid JSON ({err}); fix the file"
            ) from None
    nvme = "nvme" in (tc.offload_optimizer, tc.offload_param)
    if nvme and tc.nvme_path and not Path(tc.nvme_path).expanduser().is_dir():
        hint = loading.did_you_mean(tc.nvme_path)
        raise ConfigError(
            f"`training.nvme_path`: {tc.nvme_path} does not exist{hint}; create it on a fast local "
            f"NVMe disk (mkdir -p {tc.nvme_path}) or fix the path"
        )


def _check_resume(resume: str) -> None:
    """A path to resume from is a complete checkpoints/step-N folder (trainer/checkpoint.py)."""
    from tandem.trainer.checkpoint import STATE_FILE, list_checkpoints

    path = Path(resume).expanduser()
    if not path.exists():
        hint = loading.did_you_mean(resume)
        raise ConfigError(
            f"`training.resume_from_checkpoint`: {resume} does not exist{hint}; give a "
            "checkpoints/step-N folder or `latest`"
        )
    if (path / STATE_FILE).is_file():
        return
    found = list_checkpoints(path / "checkpoints") or list_checkpoints(path)
    if found:
        raise ConfigError(
            f"`training.resume_from_checkpoint`: {resume} is not a checkpoint but holds some; give one, "
            f"e.g. {found[-1][1]} (the newest), or `latest`"
        )
    raise ConfigError(
        f"`training.resume_from_checkpoint`: {resume} has no {STATE_FILE} (not a complete checkpoint); "
        "give a checkpoints/step-N folder or `latest`"
    )


# --------------------------------------------------------------------------- CURVE keys


def _check_curve(curve: CurveConfig, *, trainer: bool, sampler: bool) -> None:
    """The trainer's secret key and authorized folder; a sampler's two key files (made by
    `tandem keygen DIR`); each only where that side runs and only when set."""
    if trainer and curve.server_secret_key:
        _check_key_file(curve.server_secret_key, "pipeline.curve.server_secret_key", secret=True)
    if trainer and curve.authorized_clients:
        folder = Path(curve.authorized_clients).expanduser()
        key = "pipeline.curve.authorized_clients"
        if not folder.is_dir():
            hint = loading.did_you_mean(curve.authorized_clients)
            raise ConfigError(
                f"`{key}`: folder {curve.authorized_clients} does not exist{hint}; give the authorized/ "
                "folder `tandem keygen DIR` made"
            )
        if not any(folder.glob("*.key")):
            raise ConfigError(
                f"`{key}`: {curve.authorized_clients} holds no .key file, so every sampler would be "
                "refused; copy each sampler's public NAME.key there"
            )
    if sampler and curve.server_public_key:
        _check_key_file(curve.server_public_key, "pipeline.curve.server_public_key", secret=False)
    if sampler and curve.client_secret_key:
        _check_key_file(curve.client_secret_key, "pipeline.curve.client_secret_key", secret=True)


def _check_key_file(path: str, key: str, *, secret: bool) -> None:
    file = Path(path).expanduser()
    if not file.is_file():
        hint = loading.did_you_mean(path)
        raise ConfigError(f"`{key}`: {path} does not exist{hint}; make keys with `tandem keygen DIR`")
    if secret and "secret-key" not in file.read_text(errors="replace"):
        raise ConfigError(
            f"`{key}`: {path} holds no secret key; give the NAME.key_secret file, not the public NAME.key"
        )


# --------------------------------------------------------------------------- optional packages


def _check_packages(cfg: Config, *, trainer: bool) -> None:
    """Each optional package the config uses, named with the pip command that brings it."""
    missing = lambda name: importlib.util.find_spec(name) is None  # noqa: E731
    if cfg.model.lora.enabled and missing("peft"):
        raise ConfigError(
            "`model.lora.enabled` needs PEFT, which is not installed: pip install 'tandem[lora]'"
        )
    if cfg.model.attn_implementation == "flash_attention_2" and missing("flash_attn"):
        raise ConfigError(
            "`model.attn_implementation` is flash_attention_2 but flash-attn is not installed: "
            "pip install flash-attn, or set model.attn_implementation=sdpa"
        )
    if not trainer:
        return
    tc = cfg.training
    if missing("deepspeed"):
        why = _deepspeed_needed(cfg)
        if why is not None:
            raise ConfigError(
                f"`training.distributed_strategy` is {tc.distributed_strategy}{why}, but DeepSpeed is not "
                "installed: pip install 'tandem[deepspeed]'"
                + (", or set training.distributed_strategy=ddp" if tc.distributed_strategy == "auto" else "")
            )
    for reporter, fix in (
        ("tensorboard", "pip install 'tandem[tensorboard]'"),
        ("wandb", "pip install wandb"),
    ):
        if reporter in tc.report_to and missing(reporter):
            raise ConfigError(
                f"`training.report_to` includes {reporter}, which is not installed: {fix} "
                f"(or remove it from training.report_to)"
            )


def _deepspeed_needed(cfg: Config) -> str | None:
    """ "" when the strategy is deepspeed; for `auto`, why it will pick DeepSpeed (>= 1B parameters,
    counted from the safetensors headers); None when it will not, or cannot be known before loading."""
    tc: TrainingConfig = cfg.training
    if tc.distributed_strategy == "deepspeed":
        return ""
    if tc.distributed_strategy != "auto":
        return None
    num_parameters = loading.count_parameters_on_disk(cfg.model.policy)
    if num_parameters is None or num_parameters < 1e9:
        return None
    return f" and model.policy has {num_parameters / 1e9:.2f}B parameters (auto picks DeepSpeed ZeRO from 1B)"
