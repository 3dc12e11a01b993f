"""Run under torchrun by tests/integration/test_distributed.py: a few GRPO optimizer steps of the
real engine (none / ddp / deepspeed ZeRO-1/2/3) on fixed, seeded groups; rank 0 writes the final
parameters and per-step stats, so runs at different world sizes and strategies can be compared.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_driver.py MODEL_DIR OUT.pt key=value...

POISON_STEP=k gives one completion of step k an infinite advantage (its loss and gradient are then
non-finite, so the engine must skip that step); LEAVE_OUT_STEP=k runs no step k at all. Each step is
a batch of its own, whose groups stand for ones the step's weights made (so with
grpo.old_logprobs=trainer every step recomputes pi_old, and every row compares the log-probs).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tandem.config import load_config, validate_batch
from tandem.distributed.engine import build_engine
from tandem.distributed.env import all_reduce_sum, init_distributed, shutdown
from tandem.trainer.batching import flatten_groups
from tandem.trainer.grpo import optimizer_step, recompute_old_logprobs
from tandem.trainer.rl_steps import scatter_share
from tandem.trainer.run import load_policy
from tandem.types import Completion, Group

NUM_STEPS = 3


def fixed_groups(
    step: int, num_groups: int, group_size: int, vocab: int, episodes: bool = False
) -> list[Group]:
    """Seeded groups of uneven lengths (so the token balancing and padding have work to do).
    `episodes`: completions of 6 tokens or more are multi-turn episodes, a span of tool tokens
    (policy_mask 0, log-probs 0 as a sampler sends them) after their first 2 tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    groups = []
    for i in range(num_groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        rewards = torch.randn(group_size, generator=g)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        completions = []
        for j in range(group_size):
            n = int(torch.randint(2, 12, (1,), generator=g))
            old = -torch.rand(n, generator=g) * 3 - 3
            ref = -torch.rand(n, generator=g) * 3 - 3
            mask = None
            if episodes and n >= 6:
                mask = [1, 1] + [0] * min(3, n - 4) + [1] * (n - 2 - min(3, n - 4))
                old[torch.tensor(mask) == 0] = 0.0
                ref[torch.tensor(mask) == 0] = 0.0
            completions.append(
                Completion(
                    text="",
                    generated_token_ids=torch.randint(3, vocab, (n,), generator=g).tolist(),
                    old_policy_log_probs=old,
                    ref_policy_log_probs=ref,
                    reward=float(rewards[j]),
                    reward_info={},
                    advantage=float(advantages[j]),
                    is_finished=True,
                    policy_mask=mask,
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


def held(model: torch.nn.Module, env) -> list[int]:
    """Elements of the model each rank holds: in parameter storage (empty for a ZeRO-3 parameter
    outside its forward) plus its ZeRO-3 shards (`ds_tensor`)."""
    params = list(model.parameters())
    own = sum(p.numel() for p in params) + sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor"))
    mine = [0.0] * env.world_size
    mine[env.rank] = float(own)
    return [int(x) for x in all_reduce_sum(env, mine)]


def sizes(model: torch.nn.Module, env) -> dict:
    """The model's full size (`ds_numel` of a sharded parameter) and one rank's share of it under ZeRO-3."""
    full = [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]
    return {"full_numel": sum(full), "shard_numel": sum(-(-n // env.world_size) for n in full)}


def main() -> None:
    model_dir, out, *overrides = sys.argv[1:]
    episodes = "--agent-episodes" in overrides  # multi-turn episodes with tool tokens (fixed_groups)
    overrides = [o for o in overrides if o != "--agent-episodes"]
    cfg = load_config(None, [f"model.policy={model_dir}", "training.device=cpu", *overrides])
    tc = cfg.training
    device = torch.device("cpu")
    env = init_distributed(tc.distributed_strategy, "cpu")
    validate_batch(cfg, env.world_size)
    torch.manual_seed(0)
    _, model = load_policy(cfg, env, device)  # as the trainers load it (ZeRO-3: sharded, zero.Init)
    loaded = {"held_at_load": held(model, env), **sizes(model, env)}
    engine = build_engine(model, tc, env, device)
    rows = []
    poison, leave_out = (int(os.environ.get(k, -1)) for k in ("POISON_STEP", "LEAVE_OUT_STEP"))
    for step in range(NUM_STEPS):
        if step == leave_out:
            continue
        samples = []
        if env.is_main:
            groups = fixed_groups(
                step,
                cfg.grpo.prompts_per_step,
                cfg.sampling.num_generations,
                model.config.vocab_size,
                episodes,
            )
            samples = flatten_groups(groups, scale_rewards="group", adv_eps=1e-4, skip_zero_variance=False)
            if step == poison:
                samples[0].advantage = float("inf")
        share = scatter_share(env, samples if env.is_main else None, cfg)
        share.weights_version = 0  # the groups' policy_version
        mismatch = None
        if cfg.grpo.old_logprobs == "trainer":
            mismatch = recompute_old_logprobs(engine, [share], cfg, device, env)
        stats = optimizer_step(engine, share, cfg, device, env, mismatch=mismatch)
        keys = ("loss", "kl", "grad_norm", "lr", "num_train_sequences", "skipped_nonfinite")
        measured = ("ratio_abs_dev", "sampler_logprob_diff", "sampler_logprob_kl", "sampler_logprob_tokens")
        importance = ("importance_weight_mean", "importance_weight_capped")
        rows.append({k: stats.get(k) for k in (*keys, *measured, *importance)})
    loaded["held_after_steps"] = held(engine.module, env)
    with engine.gathered():
        if env.is_main:
            torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()}, out)
            with open(out + ".json", "w") as f:
                record = {"rows": rows, "world_size": env.world_size, "engine": type(engine).__name__}
                json.dump({**record, **loaded}, f)
    shutdown(env)
    # as `tandem` does under a launcher (cli.main): no interpreter teardown, where a thread of the
    # distributed stack sometimes aborts the process after a clean finish
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
