"""User reward functions for tests, loaded by import path (`tiny_rewards:digit_count`)."""


def digit_count(response: str, example) -> float:
    """Gives random models a reward with variance: the number of digits in the response, capped."""
    return float(min(sum(ch.isdigit() for ch in response), 5))


def constant(response: str, example) -> float:
    """The same reward for every completion: every group has zero variance."""
    return 1.0


def broken(completions, **kwargs):
    """A reward with a bug (TRL's convention): the first batch stops its sampler with a RewardError."""
    return [len(completion) / 0 for completion in completions]


def half_informative(response: str, example) -> float:
    """About half the prompts (by id) give every completion the same reward, the others the digit
    count: a mix of groups with and without reward variance, for dynamic sampling."""
    import zlib

    if zlib.crc32(example.prompt_id.encode()) % 2 == 0:
        return 1.0
    return digit_count(response, example)
