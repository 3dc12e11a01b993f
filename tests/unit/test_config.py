"""Config tree: defaults, YAML + overrides, round trip, and the error messages users see."""

import pytest
import yaml

from tandem.config import (
    Config,
    ConfigError,
    RewardSpec,
    TrainingConfig,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
    validate,
)


def _write(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_defaults_validate():
    cfg = load_config(None)
    assert cfg == Config()
    validate(cfg)
    assert [r.type for r in cfg.rewards] == ["answer", "format"]
    assert str(cfg.run_dir) == "runs/grpo"


def test_yaml_and_overrides_parse_types(tmp_path):
    path = _write(
        tmp_path,
        "experiment_name: gsm\n"
        "training:\n  learning_rate: 3e-6\n  micro_batch_size: 4\n"
        "model:\n  reference: some/ref\n"
        "rewards:\n  - type: answer\n  - {type: format, weight: 0.1}\n",
    )
    cfg = load_config(
        path,
        [
            "training.learning_rate=1e-5",  # YAML 1.1 reads this as a string; must become a float
            "training.report_to=[tensorboard,wandb]",
            "model.reference=null",
            "sampling.num_generations=8",
            "grpo.skip_zero_variance_groups=true",
            "training.max_grad_norm=2",  # an int is fine for a float
            "rewards.1.weight=0.5",
        ],
    )
    assert cfg.experiment_name == "gsm"
    assert cfg.training.learning_rate == 1e-5 and isinstance(cfg.training.learning_rate, float)
    assert cfg.training.micro_batch_size == 4
    assert cfg.training.report_to == ["tensorboard", "wandb"]
    assert cfg.model.reference is None
    assert cfg.sampling.num_generations == 8
    assert cfg.grpo.skip_zero_variance_groups is True
    assert cfg.training.max_grad_norm == 2.0 and isinstance(cfg.training.max_grad_norm, float)
    assert cfg.rewards[1].weight == 0.5


def test_yaml_float_written_without_dot_is_a_float(tmp_path):
    cfg = load_config(_write(tmp_path, "training:\n  learning_rate: 1e-5\n  adam_eps: 1.0e-7\n"))
    assert cfg.training.learning_rate == 1e-5
    assert cfg.training.adam_eps == 1e-7


def test_apply_overrides_does_not_mutate_input():
    d = {"training": {"max_steps": 3}}
    out = apply_overrides(d, ["training.max_steps=5", "data.num_shots=0"])
    assert d == {"training": {"max_steps": 3}}
    assert out == {"training": {"max_steps": 5}, "data": {"num_shots": 0}}


def test_round_trip_dump_load(tmp_path):
    cfg = load_config(
        None,
        [
            "experiment_name=rt",
            "training.learning_rate=2e-6",
            "training.report_to=[tensorboard]",
            "model.tokenizer=some/tok",
            "rewards=[{type: answer, weight: 2}, {type: function, function: my.mod:score, name: mine}]",
        ],
    )
    path = tmp_path / "out" / "config.yaml"
    dump_config(cfg, path)
    assert load_config(path) == cfg
    assert load_config(path).data.system_prompt == cfg.data.system_prompt


def test_unknown_top_level_key_suggests():
    with pytest.raises(ConfigError, match=r"`experiment_nam`.*did you mean `experiment_name`"):
        config_from_dict({"experiment_nam": "x"})


def test_top_level_key_that_belongs_in_a_section_suggests_the_section():
    with pytest.raises(ConfigError, match=r"did you mean `training.learning_rate`"):
        config_from_dict({"learning_rate": 1e-5})


def test_unknown_nested_key_suggests_dotted_key():
    with pytest.raises(ConfigError, match=r"`training.learnig_rate`.*did you mean `training.learning_rate`"):
        load_config(None, ["training.learnig_rate=1e-5"])


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"`sampling.zzz`.*valid keys here: num_generations"):
        config_from_dict({"sampling": {"zzz": 1}})


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"`training.max_steps` expects an integer, got 'many'"):
        config_from_dict({"training": {"max_steps": "many"}})
    with pytest.raises(ConfigError, match=r"`training.learning_rate` expects a number, got 'fast'"):
        config_from_dict({"training": {"learning_rate": "fast"}})
    with pytest.raises(ConfigError, match=r"`training.report_to` expects a list"):
        config_from_dict({"training": {"report_to": "wandb"}})
    with pytest.raises(ConfigError, match=r"`rewards\[0\].weight` expects a number"):
        config_from_dict({"rewards": [{"type": "answer", "weight": "heavy"}]})


def test_a_bare_no_is_the_choice_no_where_a_key_has_it():
    """YAML 1.1 reads `no` as false: `training.mixed_precision=no` is the user's "no", not a type
    error; a string key without that choice still names the quoting fix."""
    assert config_from_dict({"training": {"mixed_precision": False}}).training.mixed_precision == "no"
    with pytest.raises(ConfigError, match="quote the value"):
        config_from_dict({"training": {"lr_scheduler": False}})


def test_bool_is_not_a_number():
    with pytest.raises(ConfigError, match=r"`sampling.num_generations` expects an integer, got True"):
        config_from_dict({"sampling": {"num_generations": True}})
    with pytest.raises(ConfigError, match=r"`sampling.temperature` expects a number, got False"):
        config_from_dict({"sampling": {"temperature": False}})


def test_int_is_not_a_bool_and_float_is_not_an_int():
    with pytest.raises(ConfigError, match=r"`data.shuffle` expects a boolean"):
        config_from_dict({"data": {"shuffle": 1}})
    with pytest.raises(ConfigError, match=r"`training.max_steps` expects an integer, got 2.5"):
        config_from_dict({"training": {"max_steps": 2.5}})


def test_nested_section_must_be_a_mapping():
    with pytest.raises(ConfigError, match=r"`training` must be a mapping"):
        config_from_dict({"training": 3})


def test_missing_required_reward_type():
    with pytest.raises(ConfigError, match=r"`rewards\[0\].type` is required"):
        config_from_dict({"rewards": [{"weight": 1.0}]})


def test_bad_choice_lists_choices():
    with pytest.raises(
        ConfigError, match=r"`grpo.loss_agg` is 'sum'; choose one of: seq-mean-token-mean, token-mean"
    ):
        load_config(None, ["grpo.loss_agg=sum"])
    with pytest.raises(
        ConfigError, match=r"`training.report_to\[0\]` is 'mlflow'; choose from: tensorboard, wandb"
    ):
        load_config(None, ["training.report_to=[mlflow]"])
    with pytest.raises(ConfigError, match=r"`sampling.dtype`"):
        load_config(None, ["sampling.dtype=fp8"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("sampling.num_generations=1", "sampling.num_generations"),
        ("training.learning_rate=0", "training.learning_rate"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("sampling.temperature=0", "sampling.temperature"),
        ("grpo.clip_eps_low=-0.1", "grpo.clip_eps_low"),
        ("grpo.importance_cap=0.5", "grpo.importance_cap"),
        ("grpo.old_logprobs=engine", "grpo.old_logprobs"),
        ("training.device=gpu", "training.device"),
        ("experiment_name=a/b", "experiment_name"),
        ("experiment_name=''", "experiment_name"),
        ("rm.classification_loss_weight=-0.5", "rm.classification_loss_weight"),
    ],
)
def test_bounds_name_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"`{key}`"):
        load_config(None, [override])


def test_importance_correction_needs_the_trainer_s_old_logprobs():
    with pytest.raises(
        ConfigError, match=r"`grpo.importance_correction` is true .* set grpo.old_logprobs=trainer"
    ):
        load_config(None, ["grpo.importance_correction=true"])
    cfg = load_config(None, ["grpo.importance_correction=true", "grpo.old_logprobs=trainer"])
    assert (cfg.grpo.old_logprobs, cfg.grpo.importance_cap) == ("trainer", 2.0)
    assert load_config(None, ["grpo.importance_cap=1"]).grpo.importance_cap == 1.0


@pytest.mark.parametrize("value", ["0", "3", "-1"])
def test_bad_data_difficulty_names_the_key_and_levels(value):
    with pytest.raises(ConfigError, match=rf"`data.difficulty` is {value}; it must be 1 .* or 2 "):
        load_config(None, [f"data.difficulty={value}"])
    assert load_config(None, ["data.difficulty=2"]).data.difficulty == 2
    assert load_config(None).data.difficulty == 1


def test_batch_divisibility_error_suggests_accumulation():
    # 8 prompts * 4 generations = 32 sequences; 8 * 3 = 24 does not divide 32
    with pytest.raises(ConfigError) as err:
        load_config(None, ["training.gradient_accumulation_steps=3"])
    msg = str(err.value)
    assert "training.gradient_accumulation_steps" in msg
    assert "8 * 4 = 32" in msg and "8 * 3 = 24" in msg
    assert "[1, 2, 4]" in msg


def test_batch_divisibility_error_when_micro_batch_does_not_fit():
    with pytest.raises(ConfigError, match=r"training.micro_batch_size to a divisor of 32"):
        load_config(None, ["training.micro_batch_size=5", "training.gradient_accumulation_steps=1"])


def test_override_without_equals():
    with pytest.raises(ConfigError, match=r"'training.learning_rate' must have the form key=value"):
        apply_overrides({}, ["training.learning_rate"])


def test_override_into_a_scalar_or_absent_list_is_an_error():
    with pytest.raises(ConfigError, match=r"`seed` is a value, not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])
    with pytest.raises(ConfigError, match=r"the list `rewards` is not in the file; set it whole"):
        apply_overrides({}, ["rewards.0.weight=2"])
    with pytest.raises(ConfigError, match=r"`rewards.5` must index the list \(0..0\)"):
        apply_overrides({"rewards": [{"type": "answer"}]}, ["rewards.5.weight=2"])


def test_missing_file_and_bad_yaml(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope.yaml does not exist"):
        load_config(missing)
    bad = _write(tmp_path, "training: [unclosed\n", name="bad.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML"):
        load_config(bad)


def test_reward_function_spec_validation():
    ok = load_config(None, ["rewards=[{type: function, function: 'pkg.mod:my_reward'}]"])
    assert ok.rewards == [RewardSpec(type="function", function="pkg.mod:my_reward")]
    assert ok.rewards[0].resolved_name == "my_reward"
    with pytest.raises(ConfigError, match=r"`rewards\[0\].function` is None; .*'package.module:function'"):
        load_config(None, ["rewards=[{type: function}]"])
    with pytest.raises(ConfigError, match=r"`rewards\[0\].function` is 'pkg.mod.my_reward'"):
        load_config(None, ["rewards=[{type: function, function: pkg.mod.my_reward}]"])
    with pytest.raises(ConfigError, match=r"`rewards\[0\].function` is set but"):
        load_config(None, ["rewards=[{type: answer, function: 'pkg.mod:f'}]"])
    with pytest.raises(ConfigError, match=r"`rewards\[0\].type` is 'length'; choose one of"):
        load_config(None, ["rewards=[{type: length}]"])
    with pytest.raises(ConfigError, match=r"`rewards` is empty"):
        load_config(None, ["rewards=[]"])
    with pytest.raises(ConfigError, match=r"two rewards are named 'answer'"):
        load_config(None, ["rewards=[{type: answer}, {type: answer}]"])


def test_reward_factory_kwargs(tmp_path):
    spec = "rewards=[{type: function, function: 'trl.rewards:get_soft_overlong_punishment', kwargs: {max_completion_len: 128, soft_punish_cache: 32}}]"
    cfg = load_config(None, [spec, "rewards.0.kwargs.soft_punish_cache=16"])
    assert cfg.rewards[0].kwargs == {"max_completion_len": 128, "soft_punish_cache": 16}
    assert cfg.rewards[0].resolved_name == "get_soft_overlong_punishment"  # the factory's name
    path = tmp_path / "config.yaml"
    dump_config(cfg, path)
    assert load_config(path).rewards == cfg.rewards
    with pytest.raises(
        ConfigError, match=r"`rewards\[0\].kwargs` expects a mapping, got 3 \(int\); write it as a mapping"
    ):
        load_config(None, ["rewards=[{type: function, function: 'm:f', kwargs: 3}]"])


def test_config_from_dict_builds_any_section():
    assert config_from_dict({"max_steps": 3}, TrainingConfig) == TrainingConfig(max_steps=3)


def test_ppo_has_its_own_prompts_per_step_and_reads_grpo_s_when_unset(tmp_path):
    own = load_config(None, ["ppo.prompts_per_step=16"], method="ppo")
    assert (own.prompts_per_step, own.prompts_per_step_key) == (16, "ppo.prompts_per_step")
    old = load_config(None, ["grpo.prompts_per_step=16"], method="ppo")  # the older key still works
    assert (old.prompts_per_step, old.prompts_per_step_key) == (16, "grpo.prompts_per_step")
    grpo = load_config(None, ["ppo.prompts_per_step=16"], method="grpo")  # GRPO ignores PPO's key
    assert (grpo.prompts_per_step, grpo.prompts_per_step_key) == (8, "grpo.prompts_per_step")
    same = load_config(None, ["ppo.prompts_per_step=16", "grpo.prompts_per_step=16"], method="ppo")
    assert same.prompts_per_step == 16
    path = tmp_path / "config.yaml"
    dump_config(own, path)
    assert load_config(path) == own  # a dumped PPO config (grpo's key at its default) reads back


def test_ppo_refuses_two_different_prompts_per_step():
    with pytest.raises(ConfigError, match=r"`ppo.prompts_per_step` is 4 and `grpo.prompts_per_step` is 6"):
        load_config(None, ["ppo.prompts_per_step=4", "grpo.prompts_per_step=6"], method="ppo")
    with pytest.raises(ConfigError, match=r"`ppo.prompts_per_step` is 0; it must be >= 1"):
        load_config(None, ["ppo.prompts_per_step=0"], method="ppo")


def test_the_batch_check_names_the_prompts_key_in_effect():
    with pytest.raises(ConfigError, match=r"one step samples ppo.prompts_per_step \* sampling"):
        load_config(None, ["ppo.prompts_per_step=3", "training.micro_batch_size=8"], method="ppo")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["dpo.safe_mm.harmless_model=h"], r"dpo\.safe_mm\.helpful_model.*both reward models"),
        (["dpo.safe_mm.helpful_model=h"], r"dpo\.safe_mm\.harmless_model.*both reward models"),
        (
            ["dpo.safe_mm.helpful_model=h", "dpo.safe_mm.harmless_model=s", "dpo.safe_mm.safety_margin=0.5"],
            r"dpo\.safe_mm\.safety_margin.*variant: margin",
        ),
        (["dpo.safe_mm.lambda_init=20"], r"dpo\.safe_mm\.lambda_init.*lambda_min, lambda_max"),
        (["dpo.safe_mm.lambda_min=0"], r"dpo\.safe_mm\.lambda_min"),
        (["dpo.safe_mm.cost_ema_decay=1"], r"dpo\.safe_mm\.cost_ema_decay"),
        (["dpo.safe_mm.variant=lagrange"], r"dpo\.safe_mm\.variant.*lagrangian, margin"),
        (
            ["dpo.safe_mm.helpful_model=h", "dpo.safe_mm.harmless_model=s", "dpo.label_smoothing=0.1"],
            r"dpo\.label_smoothing.*lagrangian",
        ),
    ],
)
def test_safe_mm_dpo_settings_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides, method="dpo")


def test_safe_mm_dpo_variants_take_their_own_keys():
    margin = load_config(
        None,
        ["dpo.safe_mm.variant=margin", "dpo.safe_mm.harmless_model=s", "dpo.safe_mm.safety_margin=0.5"],
        method="dpo",
    )
    assert margin.dpo.safe_mm.safety_margin == 0.5 and margin.dpo.safe_mm.helpful_model is None
    both = load_config(None, ["dpo.safe_mm.helpful_model=h", "dpo.safe_mm.harmless_model=s"], method="dpo")
    assert both.dpo.safe_mm.variant == "lagrangian" and both.dpo.safe_mm.lambda_init == 1.0


def test_grpo_loss_variant_keys():
    """grpo.importance_sampling_level (GSPO) and grpo.mask_truncated_completions (DAPO): off by
    default, a wrong value names the key, and PPO, whose loss reads neither, refuses them."""
    cfg = load_config(None)
    assert (cfg.grpo.importance_sampling_level, cfg.grpo.mask_truncated_completions) == ("token", False)
    cfg = load_config(
        None, ["grpo.importance_sampling_level=sequence", "grpo.mask_truncated_completions=true"]
    )
    assert (cfg.grpo.importance_sampling_level, cfg.grpo.mask_truncated_completions) == ("sequence", True)
    with pytest.raises(
        ConfigError, match=r"`grpo.importance_sampling_level` is 'seq'; choose one of: token, sequence"
    ):
        load_config(None, ["grpo.importance_sampling_level=seq"])
    with pytest.raises(ConfigError, match=r"grpo.mask_truncated_completions"):
        load_config(None, ["grpo.mask_truncated_completions=maybe"])
    for override in ("grpo.importance_sampling_level=sequence", "grpo.mask_truncated_completions=true"):
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=rf"`{key}` is .* `tandem ppo` trains with PPO's own loss"):
            load_config(None, [override], method="ppo")
