"""Run under torchrun by tests/integration/test_distributed.py: a few GRPO optimizer steps of the
real engine (none / ddp / deepspeed ZeRO-1/2/3) on fixed, seeded groups; rank 0 writes the final
parameters and per-step stats, so runs at different world sizes and strategies can be compared.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_driver.py MODEL_DIR OUT.pt key=value...
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tandem.config import load_config, validate_batch
from tandem.distributed.engine import build_engine
from tandem.distributed.env import init_distributed, shutdown
from tandem.models.loading import load_causal_lm
from tandem.models.lora import apply_lora
from tandem.trainer.batching import flatten_groups
from tandem.trainer.grpo import optimizer_step, scatter_share
from tandem.types import Completion, Group

NUM_STEPS = 3


def fixed_groups(step: int, num_groups: int, group_size: int, vocab: int) -> list[Group]:
    """Seeded groups of uneven lengths (so the token balancing and padding have work to do)."""
    g = torch.Generator().manual_seed(1000 + step)
    groups = []
    for i in range(num_groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        rewards = torch.randn(group_size, generator=g)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        completions = []
        for j in range(group_size):
            n = int(torch.randint(2, 12, (1,), generator=g))
            completions.append(
                Completion(
                    text="",
                    generated_token_ids=torch.randint(3, vocab, (n,), generator=g).tolist(),
                    old_policy_log_probs=-torch.rand(n, generator=g) * 3 - 3,
                    ref_policy_log_probs=-torch.rand(n, generator=g) * 3 - 3,
                    reward=float(rewards[j]),
                    reward_info={},
                    advantage=float(advantages[j]),
                    is_finished=True,
                )
            )
        groups.append(
            Group(
                group_id=f"g{step}-{i}",
                prompt_id=str(i),
                prefix="",
                prefix_token_ids=prompt,
                completions=completions,
                policy_version=0,
            )
        )
    return groups


def main() -> None:
    model_dir, out, *overrides = sys.argv[1:]
    cfg = load_config(None, [f"model.policy={model_dir}", "training.device=cpu", *overrides])
    tc = cfg.training
    device = torch.device("cpu")
    env = init_distributed(tc.distributed_strategy, "cpu")
    validate_batch(cfg, env.world_size)
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, dtype="float32")
    if cfg.model.lora.enabled:
        model = apply_lora(model, cfg.model.lora)
    if tc.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    engine = build_engine(model, tc, env, device)
    rows = []
    for step in range(NUM_STEPS):
        samples = []
        if env.is_main:
            groups = fixed_groups(
                step, cfg.grpo.prompts_per_step, cfg.sampling.num_generations, model.config.vocab_size
            )
            samples = flatten_groups(groups, scale_rewards="group", adv_eps=1e-4, skip_zero_variance=False)
        share = scatter_share(env, samples if env.is_main else None, cfg)
        stats = optimizer_step(engine, share, cfg, device, env)
        rows.append({k: stats[k] for k in ("loss", "kl", "grad_norm", "lr", "num_train_sequences")})
    with engine.gathered():
        if env.is_main:
            torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()}, out)
            with open(out + ".json", "w") as f:
                json.dump({"rows": rows, "world_size": env.world_size, "engine": type(engine).__name__}, f)
    shutdown(env)
    # as `tandem` does under a launcher (cli.main): no interpreter teardown, where a thread of the
    # distributed stack sometimes aborts the process after a clean finish
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
