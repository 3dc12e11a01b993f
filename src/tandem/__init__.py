"""tandem: RL post-training of LLMs (GRPO with a decoupled sampler/trainer, SFT, RM, DPO, PPO)."""

__version__ = "0.1.0"
