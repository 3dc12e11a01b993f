"""Preflight: every mistake in a config is named (key and fix) before any model loads.

Real files in tmp_path; the hub is a local HTTP server that counts requests (or a closed port),
so no test reaches the network or waits on a timeout.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest
import torch

from tandem.config import ConfigError, load_config
from tandem.models.loading import (
    check_model_spec,
    count_parameters_on_disk,
    is_hub_id,
    resolve_model_path,
)
from tandem.preflight import check_dataset, check_device, check_run

# --------------------------------------------------------------------------- fixtures


class Hub:
    """A stand-in hub on 127.0.0.1: repos in `known` exist, every other id is RepoNotFound."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.known: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                hub.requests.append(self.path)
                repo = self.path.split("?")[0].split("/", 3)[-1]
                found = any(self.path.split("?")[0].endswith(f"/{k}") for k in hub.known)
                body = json.dumps({"id": repo, "sha": "0" * 40, "siblings": []}).encode()
                self.send_response(200 if found else 404)
                if not found:
                    self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def probes(self) -> list[str]:
        """Requests for repos (huggingface_hub may also fetch its own registry once)."""
        return [r for r in self.requests if r.startswith(("/api/models/", "/api/datasets/"))]


@pytest.fixture(autouse=True)
def isolated_hub(tmp_path, monkeypatch):
    """Every test: an empty hub cache, online mode, and a hub that is a local server."""
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub = Hub()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)  # its own registry fetch
    monkeypatch.chdir(tmp_path)
    yield hub
    hub.server.shutdown()
    hub.server.server_close()


def packages(monkeypatch, *, absent=(), present=()):
    """Pretend optional packages are missing (or installed): the environment, not the check."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in absent:
            return None
        if name in present:
            return ModuleSpec(name, None)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def model_dir(path: Path) -> Path:
    """An HF model folder as far as any check is concerned (config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def config(*overrides: str, method: str | None = None):
    model = model_dir(Path("model"))
    return load_config(None, [f"model.policy={model}", "training.device=cpu", *overrides], method=method)


def refused(command: str, *overrides: str, method: str | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        check_run(config(*overrides, method=method), command)
    return str(err.value)


def test_a_good_config_passes_for_every_command():
    for command in ("grpo", "ppo", "train", "sample", "launch"):
        check_run(config(), command)
    for method in ("sft", "rm", "dpo"):
        check_run(config(method=method), method)


# --------------------------------------------------------------------------- model specs


def test_a_misspelt_run_folder_names_the_real_one_without_the_hub(isolated_hub):
    model_dir(Path("runs/sft_tiny/final"))
    message = refused("grpo", "model.policy=sft_tny/final")
    assert message == "`model.policy`: sft_tny/final does not exist (did you mean runs/sft_tiny/final?)"
    # the loader refuses it the same way, so `tandem eval` and the trainers never retry the hub
    with pytest.raises(FileNotFoundError, match="did you mean runs/sft_tiny/final"):
        resolve_model_path("sft_tny/final")
    assert isolated_hub.probes() == []


def test_a_run_folder_without_runs_prefix_and_with_a_typo_deeper_down():
    model_dir(Path("runs/sft_tiny/final"))
    assert "did you mean runs/sft_tiny/final?" in refused("grpo", "model.policy=sft_tiny/final")
    assert "did you mean runs/sft_tiny/final?" in refused("grpo", "model.policy=runs/sft_tny/final")


def test_a_missing_local_path_names_the_nearest_folder_and_the_forms():
    Path("models").mkdir()
    message = refused("sft", "model.policy=./models/qwen/final", method="sft")
    assert "`model.policy`: ./models/qwen/final does not exist" in message
    assert "nearest existing folder is models/" in message


def test_a_run_folder_is_not_a_model_but_its_final_is():
    model_dir(Path("runs/sft_tiny/final"))
    message = refused("grpo", "model.policy=runs/sft_tiny")
    assert "`model.policy`: runs/sft_tiny is a run folder" in message and "runs/sft_tiny/final" in message


def test_a_checkpoint_folder_is_a_model_and_loads_from_model():
    step = Path("runs/x/checkpoints/step-4")
    model_dir(step / "model")
    assert check_model_spec(str(step), "model.policy") == "checkpoint"
    assert resolve_model_path(str(step)) == str(step / "model")


def test_lora_adapters_alone_are_refused_naming_the_merged_folder():
    step = Path("runs/lora/checkpoints/step-2/model")
    step.mkdir(parents=True)
    (step / "adapter_config.json").write_text("{}")
    assert "LoRA adapters only" in refused("grpo", f"model.policy={step}")


def test_a_misspelt_embedded_is_named():
    assert "embeded does not exist (did you mean embedded?)" in refused("grpo", "model.policy=embeded")


def test_a_missing_gguf_file_and_a_missing_tokenizer_and_reference():
    Path("models").mkdir()
    Path("models/smol.gguf").write_bytes(b"GGUF")
    assert "did you mean models/smol.gguf?" in refused("grpo", "model.policy=models/smoll.gguf")
    assert "`model.tokenizer`: tok/x/y does not exist" in refused("grpo", "model.tokenizer=tok/x/y")
    assert "`model.reference`" in refused("grpo", "model.reference=./ref")
    # the trainer of a grpo run never loads the reference (the sampler does)
    check_run(config("model.reference=./ref"), "train")


def test_hub_ids_and_paths_are_told_apart():
    assert is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and is_hub_id("gpt2") and is_hub_id("sft_tny/final")
    assert not is_hub_id("runs/sft_tiny/final") and not is_hub_id("./model") and not is_hub_id("m.gguf")
    assert not is_hub_id("data/train.jsonl") and not is_hub_id("../model")


def test_offline_and_not_cached_fails_at_once_without_a_request(isolated_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = refused("grpo", "model.policy=Qwen/Qwen2.5-1.5B-Instruct")
    assert "`model.policy`: Qwen/Qwen2.5-1.5B-Instruct" in message
    assert "not in the local cache and offline mode is on" in message
    with pytest.raises(FileNotFoundError, match="offline mode is on"):
        resolve_model_path("Qwen/Qwen2.5-1.5B-Instruct")
    assert isolated_hub.requests == []


def test_a_cached_hub_id_passes_offline_without_a_request(isolated_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir(tmp_path / "hf/hub/models--Qwen--Qwen2.5-1.5B-Instruct/snapshots/abc")
    assert check_model_spec("Qwen/Qwen2.5-1.5B-Instruct", "model.policy") == "hub-cached"
    assert resolve_model_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    assert isolated_hub.requests == []


def test_a_hub_id_is_probed_once(isolated_hub):
    isolated_hub.known.add("org/exists")
    assert check_model_spec("org/exists", "model.policy") == "hub"
    assert isolated_hub.probes() == ["/api/models/org/exists"]


def test_an_unknown_hub_id_is_named_after_one_request(isolated_hub):
    message = refused("grpo", "model.policy=org/nothing")
    assert "`model.policy`: org/nothing is not a local path and the hub has no model org/nothing" in message
    assert "check the spelling" in message
    assert isolated_hub.probes() == ["/api/models/org/nothing"]


def test_an_unreachable_hub_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    message = refused("grpo", "model.policy=org/name")
    assert (
        "`model.policy`: org/name is not a local path and the hub (http://127.0.0.1:9) cannot be reached"
        in message
    )
    assert "HF_HUB_OFFLINE=1" in message


def test_hub_probes_come_after_every_local_check(isolated_hub):
    message = refused("grpo", "model.policy=org/name", "data.dataset=data/train.jsonl")
    assert message.startswith("`data.dataset`")
    assert isolated_hub.probes() == []


# --------------------------------------------------------------------------- data


def test_a_missing_data_file_names_the_closest_sibling():
    Path("data").mkdir()
    Path("data/train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    message = refused("grpo", "data.dataset=data/trian.jsonl")
    assert message == "`data.dataset`: data/trian.jsonl does not exist (did you mean data/train.jsonl?)"


def test_a_missing_data_folder_walks_up_to_the_deepest_existing_one():
    Path("data").mkdir()
    message = refused("grpo", "data.dataset=data/gsm/x/train.jsonl")
    assert "data/gsm/x/train.jsonl does not exist (the nearest existing folder is data/)" in message


def test_a_folder_without_the_split_names_the_splits_it_holds():
    Path("gsm").mkdir()
    Path("gsm/train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    check_run(config("data.dataset=gsm"), "grpo")
    message = refused("grpo", "data.dataset=gsm", "data.split=test")
    assert "gsm has no test.jsonl" in message and "set data.split=train" in message


def test_folders_are_for_prompts_only():
    Path("prefs").mkdir()
    Path("prefs/train.jsonl").write_text("{}\n")
    assert "prefs is a folder; rm and dpo read one .jsonl/.parquet file" in refused(
        "dpo", "data.dataset=prefs", method="dpo"
    )


def test_files_tandem_cannot_read_are_named():
    Path("rows.txt").write_text("question,answer\n")
    Path("rows.jsonl").write_text('[{"question": "q"}]')
    assert "rows.txt is not JSON lines" in refused("sft", "data.dataset=rows.txt", method="sft")
    assert "holds a JSON array; name it .json" in refused("sft", "data.dataset=rows.jsonl", method="sft")
    Path("rows.csv").write_text("prompt,solution\nWhat is 2+2?,4\n")
    Path("rows.json").write_text('[{"prompt": "What is 2+2?", "solution": "4"}]')
    for name in ("rows.csv", "rows.json"):  # read as prompt sets
        check_run(config(f"data.dataset={name}"), "grpo")


def test_a_bad_prompt_row_is_named_before_any_model_loads():
    Path("tasks.jsonl").write_text(
        '{"prompt": [{"role": "user", "content": "hi"}], "solution": "1"}\n'
        '{"prompt": [{"role": "user", "text": "hi"}], "solution": "2"}\n'
    )
    message = refused("grpo", "data.dataset=tasks.jsonl")
    assert message == "`data.dataset`: tasks.jsonl:2: column `prompt`, message 0: needs a string `content`"
    Path("tasks.jsonl").write_text('{"question": "q", "solution": "1"}\n')
    message = refused("grpo", "data.dataset=tasks.jsonl")
    assert "tasks.jsonl:1: no `prompt` column (data.prompt_column)" in message
    assert "['question', 'solution']" in message
    check_run(config("data.dataset=tasks.jsonl", "data.prompt_column=question"), "grpo")
    Path("shots.jsonl").write_text('{"prompt": "1+1?", "completion": "2"}\n')
    message = refused(
        "grpo",
        "data.dataset=tasks.jsonl",
        "data.prompt_column=question",
        "data.shots=shots.jsonl",
        "data.num_shots=3",
    )
    assert "num_shots is 3 but data.shots (shots.jsonl) hold 1" in message


def test_parquet_needs_pyarrow(monkeypatch):
    Path("rows.parquet").write_bytes(b"PAR1")
    packages(monkeypatch, absent=("pyarrow", "pandas"))
    assert "pip install pyarrow" in refused("sft", "data.dataset=rows.parquet", method="sft")


def test_gsm8k_from_the_hub_needs_the_hub_extra(monkeypatch):
    packages(monkeypatch, absent=("datasets",))
    message = refused("grpo", "data.dataset=gsm8k")
    assert "`data.dataset`: gsm8k loads openai/gsm8k from the hub" in message
    assert "pip install 'tandem[hub]'" in message and "local copy" in message
    assert "pip install 'tandem[hub]'" in refused("sft", "data.dataset=org/pairs", method="sft")


def test_a_local_gsm8k_folder_is_not_the_hub(monkeypatch):
    packages(monkeypatch, absent=("datasets",))
    Path("gsm8k").mkdir()
    Path("gsm8k/train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    check_run(config("data.dataset=gsm8k"), "grpo")


def test_a_hub_data_set_offline_and_not_cached_fails_at_once(isolated_hub, monkeypatch):
    packages(monkeypatch, present=("datasets",))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    message = refused("rm", "data.dataset=PKU-Alignment/PKU-SafeRLHF", method="rm")
    assert "`data.dataset`" in message and "offline" in message
    assert isolated_hub.requests == []


def test_a_hub_data_set_is_probed_as_a_data_set(isolated_hub, monkeypatch):
    packages(monkeypatch, present=("datasets",))
    isolated_hub.known.add("org/pairs")
    check_run(config("data.dataset=org/pairs", method="dpo"), "dpo")
    assert isolated_hub.probes() == ["/api/datasets/org/pairs"]
    assert "the hub has no data set org/other" in refused("dpo", "data.dataset=org/other", method="dpo")


def test_data_names_that_are_no_source_are_named():
    assert "did you mean synthetic?" in refused("grpo", "data.dataset=synthtic")
    message = refused("grpo", "data.dataset=org/prompts")  # prompts may come from the hub now:
    # without `datasets` the fix is to install it, with it the hub is asked (no such set)
    assert "org/prompts is a hub data set" in message or "the hub has no data set org/prompts" in message
    assert "has no preference pairs" in refused("rm", "data.dataset=gsm8k", method="rm")


def test_the_held_out_set_is_checked_where_it_is_read():
    message = refused("sft", "data.eval_dataset=held/out.jsonl", method="sft")
    assert message.startswith("`data.eval_dataset`: held/out.jsonl does not exist")
    check_run(config("data.eval_dataset=held/out.jsonl"), "grpo")  # grpo never reads it


def test_the_trainer_alone_does_not_read_prompts():
    check_run(config("data.dataset=data/missing.jsonl"), "train")
    assert "`data.dataset`" in refused("sample", "data.dataset=data/missing.jsonl")


# --------------------------------------------------------------------------- rewards


def test_reward_functions_import_before_any_model_loads():
    ok = "rewards=[{type: function, function: 'tiny_rewards:digit_count'}]"
    check_run(config(ok), "sample")
    message = refused("grpo", "rewards=[{type: answer}, {type: function, function: 'no_such_mod:fn'}]")
    assert message.startswith("`rewards[1].function`") and "no_such_mod" in message
    message = refused("grpo", "rewards=[{type: function, function: 'tiny_rewards:digits'}]")
    assert "has no attribute 'digits'" in message and "check the function's name in tiny_rewards" in message
    message = refused("grpo", "rewards=[{type: function, function: 'os.path:isfile'}]")
    assert "fn(response: str, example: Example)" in message
    check_run(config("rewards=[{type: function, function: 'no_such_mod:fn'}]"), "train")  # scored by samplers


FACTORIES = """
CALLS = []

def make_penalty(max_len):
    CALLS.append(max_len)
    def penalty(completion_ids, **kwargs):
        return [-float(len(ids) > max_len) for ids in completion_ids]
    return penalty

def make_broken(max_len):
    raise ValueError("max_len must be positive")

def needs_state(completions, trainer_state, **kwargs):
    return [0.0 for _ in completions]
"""


def test_reward_factories_are_called_in_preflight(monkeypatch, capsys):
    Path("preflight_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(Path.cwd()))
    import preflight_factories

    spec = "rewards=[{type: function, function: 'preflight_factories:make_penalty', kwargs: {max_len: 4}}]"
    check_run(config(spec), "sample")
    assert preflight_factories.CALLS == [4]
    message = refused(
        "grpo",
        "rewards=[{type: function, function: 'preflight_factories:make_broken', kwargs: {max_len: 0}}]",
    )
    assert message.startswith("`rewards[0].kwargs`: preflight_factories:make_broken(**{'max_len': 0}) raised")
    assert "max_len must be positive" in message
    message = refused("launch", "rewards=[{type: function, function: 'preflight_factories:needs_state'}]")
    assert "'trainer_state' has no default, and tandem does not pass trainer_state" in message

    # the CLI refuses before it loads any model (`model.policy` here is not even a model)
    from tandem.cli import main

    argv = ["grpo", "pipeline.mode=colocated", "model.policy=no/such-model-here", "training.device=cpu"]
    assert (
        main(
            [
                *argv,
                "rewards=[{type: function, function: 'preflight_factories:make_broken', kwargs: {max_len: 0}}]",
            ]
        )
        == 2
    )
    assert "`rewards[0].kwargs`" in capsys.readouterr().err
    sys.modules.pop("preflight_factories")


def test_a_reward_module_in_the_current_folder_names_pythonpath(monkeypatch):
    Path("my_rewards_here.py").write_text("def brevity(response, example):\n    return 1.0\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(Path.cwd()))])
    message = refused("grpo", "rewards=[{type: function, function: 'my_rewards_here:brevity'}]")
    assert "PYTHONPATH=." in message


def test_reward_model_folders():
    message = refused("grpo", "rewards=[{type: model, path: runs/rm_helpful/final}]")
    assert message.startswith("`rewards[0].path`: runs/rm_helpful/final does not exist")
    assert "tandem rm" in message
    message = refused(
        "dpo",
        "dpo.safe_mm.variant=margin",
        "dpo.safe_mm.harmless_model=runs/rm_harmless/final",
        method="dpo",
    )
    assert "`dpo.safe_mm.harmless_model`" in message and "tandem rm configs/rm_harmless.yaml" in message


# --------------------------------------------------------------------------- devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused_for_every_training_command():
    for command in ("grpo", "ppo", "train", "launch"):
        message = refused(command, "training.device=cuda")
        assert message.startswith("`training.device` is cuda but torch.cuda.is_available() is False")
        assert f"torch {torch.__version__}" in message
        assert "set training.device=cpu or install a CUDA build of torch" in message
    for method in ("sft", "rm", "dpo"):
        assert "training.device=cpu" in refused(method, "training.device=cuda:0", method=method)
    check_run(config("training.device=auto"), "grpo")
    check_run(config("training.device=cuda"), "sample")  # a sampler's device is its --device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_beyond_the_devices_is_refused():
    count = torch.cuda.device_count()
    check_device("cuda:0")
    with pytest.raises(ConfigError, match=f"torch sees {count} CUDA device"):
        check_device(f"cuda:{count}")


# --------------------------------------------------------------------------- trainer files


def test_resume_paths():
    step = Path("runs/a/checkpoints/step-6")
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    check_run(config(f"training.resume_from_checkpoint={step}"), "train")
    check_run(config("training.resume_from_checkpoint=latest"), "train")
    message = refused("train", "training.resume_from_checkpoint=runs/a/checkpoints/step-5")
    assert "does not exist (did you mean runs/a/checkpoints/step-6?)" in message
    message = refused("train", "training.resume_from_checkpoint=runs/a")
    assert "runs/a is not a checkpoint" in message and "runs/a/checkpoints/step-6" in message


def test_deepspeed_json_and_nvme_folder():
    Path("ds.json").write_text("{not json")
    strategy = "training.distributed_strategy=deepspeed"
    assert "does not exist" in refused("train", strategy, "training.deepspeed_config=zero9.json")
    assert "is not valid JSON" in refused("train", strategy, "training.deepspeed_config=ds.json")
    message = refused(
        "train", strategy, "training.offload_optimizer=nvme", "training.nvme_path=/no/such/nvme"
    )
    assert message.startswith("`training.nvme_path`: /no/such/nvme does not exist") and "mkdir -p" in message


# --------------------------------------------------------------------------- CURVE keys


def test_curve_key_files_per_side():
    from tandem.transport.auth import keygen

    keygen("keys", ["trainer", "sampler"])
    trainer = [
        "pipeline.curve.server_secret_key=keys/trainer.key_secret",
        "pipeline.curve.authorized_clients=keys/authorized",
    ]
    sampler = [
        "pipeline.curve.server_public_key=keys/trainer.key",
        "pipeline.curve.client_secret_key=keys/sampler.key_secret",
    ]
    for command in ("train", "sample", "grpo"):
        check_run(config(*trainer, *sampler), command)
    message = refused("train", "pipeline.curve.server_secret_key=keys/trainer.key", trainer[1], *sampler)
    assert "`pipeline.curve.server_secret_key`" in message and "holds no secret key" in message
    wrong = ["pipeline.curve.server_public_key=keys/trainr.key", sampler[1]]
    assert "did you mean keys/trainer.key?" in refused("sample", *trainer, *wrong)
    check_run(config(*trainer, *wrong), "train")  # the trainer never reads a sampler's keys
    Path("empty").mkdir()
    message = refused("train", trainer[0], "pipeline.curve.authorized_clients=empty", *sampler)
    assert "holds no .key file" in message


# --------------------------------------------------------------------------- optional packages


def test_optional_packages_name_their_extra(monkeypatch):
    packages(monkeypatch, absent=("deepspeed", "peft", "tensorboard", "wandb"))
    message = refused("train", "training.distributed_strategy=deepspeed")
    assert "DeepSpeed is not installed: pip install 'tandem[deepspeed]'" in message
    assert "pip install 'tandem[lora]'" in refused("sample", "model.lora.enabled=true")
    assert "pip install 'tandem[tensorboard]'" in refused(
        "sft", "training.report_to=[tensorboard]", method="sft"
    )
    assert "pip install wandb" in refused("train", "training.report_to=[wandb]")
    check_run(config("training.report_to=[wandb]"), "sample")  # samplers report nothing


def _safetensors_header(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file's header (the tensors' data is never read by the count)."""
    header = json.dumps(
        {name: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]} for name, s in shapes.items()}
    )
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode())


def test_auto_needs_deepspeed_only_when_the_model_is_known_to_be_large(isolated_hub, monkeypatch):
    packages(monkeypatch, absent=("deepspeed",))
    big = model_dir(Path("big"))
    _safetensors_header(big / "model.safetensors", {"embed": [50_000, 20_000], "head": [20_000, 25_000]})
    assert count_parameters_on_disk(str(big)) == 1_500_000_000
    message = refused("train", "training.distributed_strategy=auto", f"model.policy={big}")
    assert "1.50B parameters" in message and "tandem[deepspeed]" in message
    assert "training.distributed_strategy=ddp" in message
    small = model_dir(Path("small"))
    _safetensors_header(small / "model.safetensors", {"embed": [1000, 64]})
    check_run(config("training.distributed_strategy=auto", f"model.policy={small}"), "train")
    isolated_hub.known.add("org/unknown-size")  # a hub id: its size is unknown until it loads
    check_run(config("training.distributed_strategy=auto", "model.policy=org/unknown-size"), "train")


def test_check_dataset_for_eval_names_its_flags():
    Path("gsm").mkdir()
    Path("gsm/train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(ConfigError, match="set --split train"):
        check_dataset("gsm", "--dataset", split="test", split_key="--split")
    assert check_dataset("gsm/train.jsonl", "--dataset", split="test") == "file"


def test_an_evaluation_needs_held_out_prompts():
    Path("tasks.jsonl").write_text('{"prompt": "What is 2+2?", "solution": "4"}\n')
    message = refused("grpo", "data.dataset=tasks.jsonl", "eval.steps=5")
    assert "`eval.dataset` is unset and data.dataset tasks.jsonl is one file" in message
    Path("held.jsonl").write_text('{"prompt": ["bad"]}\n')
    message = refused("grpo", "data.dataset=tasks.jsonl", "eval.steps=5", "eval.dataset=held.jsonl")
    assert message.startswith("`eval.dataset`: held.jsonl:1: column `prompt`, message 0")
    check_run(config("data.dataset=tasks.jsonl", "eval.steps=5", "eval.dataset=tasks.jsonl"), "grpo")
    check_run(config("eval.steps=5"), "grpo")  # synthetic: its test split is held out
