"""Agentic RL building blocks (issue 20, in progress): tools and environments in TRL's conventions,
tool-call parsing, and a runner that keeps every failure of a tool away from the sampler.

Not wired into the sampler yet: the multi-turn episode loop, the wire's per-token policy mask and
the loss mask come next (see the issue's note)."""
