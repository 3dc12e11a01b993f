"""Run under torchrun by tests/integration/test_ppo.py: a few PPO batches of the real engine on fixed,
seeded groups (tests/dist_driver.py's); rank 0 writes the final policy and value-head parameters
and per-step stats, so runs at different world sizes can be compared.

    python -m torch.distributed.run --nproc-per-node 2 tests/ppo_dist_driver.py MODEL_DIR OUT.pt key=value...
"""

from __future__ import annotations

import json
import os
import sys

import torch

from dist_driver import fixed_groups
from tandem.config import load_config, validate_batch
from tandem.distributed.engine import build_engine
from tandem.distributed.env import init_distributed, shutdown
from tandem.models.value_head import ValueHeadModel
from tandem.trainer.batching import flatten_groups
from tandem.trainer.ppo import optimizer_step, prepare_batch
from tandem.trainer.rl_steps import scatter_batch
from tandem.trainer.run import load_policy

NUM_BATCHES = 2


def seeded_value_head(forward: ValueHeadModel) -> None:
    """A non-zero head, so that the value loss also sends gradients into the trunk."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        forward.value_head.weight.copy_(torch.randn(forward.value_head.weight.shape, generator=g) * 0.3)
        forward.value_head.bias.fill_(-0.5)


def main() -> None:
    model_dir, out, *overrides = sys.argv[1:]
    cfg = load_config(None, ["method=ppo", f"model.policy={model_dir}", "training.device=cpu", *overrides])
    tc = cfg.training
    device = torch.device("cpu")
    env = init_distributed(tc.distributed_strategy, "cpu")
    validate_batch(cfg, env.world_size)
    torch.manual_seed(0)
    _, model = load_policy(cfg, env, device)  # as the trainers load it (ZeRO-3: sharded, zero.Init)
    forward = ValueHeadModel(model)
    seeded_value_head(forward)
    engine = build_engine(model, tc, env, device, forward=forward)
    rows = []
    for index in range(NUM_BATCHES):
        samples = []
        if env.is_main:
            groups = fixed_groups(
                index, cfg.prompts_per_step, cfg.sampling.num_generations, model.config.vocab_size
            )
            samples = flatten_groups(groups, scale_rewards="none", adv_eps=0.0, skip_zero_variance=False)
        batches, stats = prepare_batch(engine, scatter_batch(env, samples, cfg), cfg, device, env)
        for _ in range(cfg.ppo.num_iterations):
            for batch in batches:
                step = optimizer_step(engine, batch, cfg, device, env)
                keys = ("loss", "value_loss", "kl", "grad_norm", "num_train_sequences", "vf_clip_fraction")
                rows.append({**{k: step[k] for k in keys}, **stats, "num_batches": len(batches)})
    with engine.gathered():
        if env.is_main:
            params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
            params.update(
                {f"value_head.{k}": v.detach().clone() for k, v in forward.value_head.state_dict().items()}
            )
            torch.save(params, out)
            with open(out + ".json", "w") as f:
                json.dump({"rows": rows, "world_size": env.world_size}, f)
    shutdown(env)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/dist_driver.py: no interpreter teardown under a launcher


if __name__ == "__main__":
    main()
