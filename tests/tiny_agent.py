"""Tools and an environment in TRL's conventions, for agent runs in tests (`tiny_agent:add`)."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Notebook:
    """A TRL environment_factory class: reset with the row, public methods are tools."""

    def reset(self, answer: str, **row) -> None:
        self.answer, self.notes = answer, []

    def write(self, text: str) -> str:
        """Write a note.

        Args:
            text: the note
        """
        self.notes.append(text)
        return "noted"

    def get_reward(self) -> float:
        return float(len(self.notes) > 0)


def notes_written(completions, environments, **kwargs):
    """A reward that reads each episode's environment (TRL's `environments` keyword)."""
    return [float(len(env.notes)) for env in environments]


def turns(completions, **kwargs):
    """A reward that reads the episode's messages: minus the number of assistant turns."""
    return [-float(sum(m["role"] == "assistant" for m in c)) for c in completions]
