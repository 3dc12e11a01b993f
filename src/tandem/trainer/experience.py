"""Where the GRPO trainer's groups come from and where its weights go, in either pipeline mode.

- `LocalExperience` (colocated, one process): a `Rollout` on a copy of the policy in this process;
  new weights are copied into that copy before the next batch.
- `RemoteExperience` (decoupled trainer): groups arrive from sampler processes over the data
  channel, are filtered for staleness, and new weights are published on the sync channel every
  `pipeline.sync_every` optimizer steps.
Both hand the loop `(groups, stats)` for each batch, so `trainer/grpo.py` is one loop for both.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.atomic import atomic_write_text
from tandem.config import Config
from tandem.data.stream import PromptStream
from tandem.models.lora import sync_tensors
from tandem.sampler.dynamic import GroupFilter, filtered_fields
from tandem.sampler.evaluation import Evaluator, row_fields
from tandem.sampler.rollout import Rollout, RolloutTimings
from tandem.transport.admission import GroupLimits
from tandem.transport.pacing import age, announce, drop_reason, publishes_at, version_base
from tandem.types import GROUP_TIMINGS, Group

log = logging.getLogger(__name__)

STARVED_AFTER_S = 5.0  # waiting this long for groups makes samplers at their quota produce more
SYNC_STATE_FILE = "sync_state.json"
FINISH_LINGER_S = 60.0  # a finished trainer waits at most this long for samplers to hear it
KEEP_ALIVE_S = 60.0  # a distributed trainer's rank 0 tells the others it still waits this often


class LocalExperience:
    """Colocated: generate each batch in this process, with the newest weights."""

    def __init__(
        self,
        rollout: Rollout,
        stream: PromptStream,
        policy: torch.nn.Module,
        evaluator: Evaluator | None = None,
        group_filter: GroupFilter | None = None,
    ) -> None:
        self.rollout, self.stream, self.policy = rollout, stream, policy
        self.evaluator = evaluator  # eval.steps > 0: held-out evaluations between steps
        self.filter = group_filter  # grpo.dynamic_sampling (sampler/dynamic.py)
        self.pending_evals: list[tuple[int, dict]] = []
        self.version = 0
        self._stale_copy = False

    def next_groups(
        self, num_groups: int, keep_alive: Callable[[], None] | None = None
    ) -> tuple[list[Group], dict]:
        if self._stale_copy:
            copy_weights(self.policy, self.rollout.policy)
            self._stale_copy = False
        if self.filter is None:
            groups = self.rollout.run(self.stream.next_batch(), policy_version=self.version)
            times, tokens = self.rollout.timings, None
        else:
            groups, times, tokens = self._informative_groups(num_groups)
        lengths = sum(len(c.generated_token_ids) for g in groups for c in g.completions)
        stats = {
            "time_generate": times.generate,
            "time_reference": times.reference,
            "time_reward": times.reward,
            "generate_tokens_per_second": (tokens or lengths) / max(times.generate, 1e-9),
            "wait_seconds": 0.0,
            "groups_dropped_stale": 0,
        }
        if self.filter is not None:
            stats.update(filtered_fields(groups))
        return groups, stats

    def _informative_groups(self, num_groups: int) -> tuple[list[Group], RolloutTimings, int]:
        """Dynamic sampling: generate the batch's missing groups from fresh prompts until
        `num_groups` are kept (the filter keeps every group once its cap is spent); the time and
        generated tokens of every round, dropped groups included."""
        groups: list[Group] = []
        times, tokens = RolloutTimings(), 0
        while len(groups) < num_groups:
            made = self.rollout.run(
                self.stream.next_batch(num_groups - len(groups)), policy_version=self.version
            )
            t = self.rollout.timings
            times.generate, times.reference, times.reward = (
                times.generate + t.generate,
                times.reference + t.reference,
                times.reward + t.reward,
            )
            tokens += sum(len(c.generated_token_ids) for g in made for c in g.completions)
            groups += self.filter.admit(made)
        return groups, times, tokens

    def expect(self, step: int, steps: int, steps_per_batch: int) -> None:
        pass  # no sampler to pace

    def age(self, group: Group) -> int:
        return self.version - group.policy_version

    def weights_version(self) -> int | None:
        """The version of the weights the trainer holds now (every step makes one here)."""
        return self.version

    def on_step(self, policy: torch.nn.Module, step: int) -> dict:
        self.version += 1  # one version per optimizer step, as a decoupled trainer with sync_every 1
        self._stale_copy = True  # copied lazily: several optimizer steps may share one batch
        evals, self.pending_evals = self.pending_evals, []
        if self.evaluator is not None and self.evaluator.due(self.version):
            evals.append((self.version, self.evaluate()))
        return row_fields(evals)

    def evaluate(self) -> dict:
        """The held-out evaluation of the version this process holds now (eval.*)."""
        if self._stale_copy:
            copy_weights(self.policy, self.rollout.policy)
            self._stale_copy = False
        return self.evaluator.run(self.version)

    def evaluate_initial(self) -> None:
        """Before the first step of a fresh run: version 0's evaluation, logged in the first row."""
        if self.evaluator is not None and self.version == 0 and self.evaluator.due(0):
            self.pending_evals.append((0, self.evaluate()))

    def state_dict(self) -> dict:
        state = {
            "data": self.stream.state_dict(),
            "policy_version": self.version,
            "stale_copy": self._stale_copy,
        }
        if self.filter is not None:
            state["filter"] = self.filter.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["data"])
        if self.filter is not None and "filter" in state:
            self.filter.load_state_dict(state["filter"])
        self.version = int(state.get("policy_version", 0))
        self._stale_copy = bool(state.get("stale_copy", False))
        copy_weights(self.policy, self.rollout.policy)

    def close(self, *, finished: bool) -> None:
        pass


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy the trained weights into the rollout copy (casting to its dtype); no-op when shared."""
    if src is dst:
        return
    for p_dst, p_src in zip(dst.parameters(), src.parameters()):
        p_dst.copy_(p_src)


class RemoteExperience:
    """Decoupled trainer: PULL groups from samplers, drop stale ones, publish weights.

    Versions never repeat within a run folder: a restarted trainer continues after the last
    version it published (recorded in `<run_dir>/sync_state.json`), so a sampler can always tell
    new weights from old, and groups from a lost future (`policy_version` above ours) are dropped.
    """

    def __init__(self, cfg: Config, run_dir: Path, policy: torch.nn.Module) -> None:
        import zmq

        self.cfg, self.run_dir = cfg, run_dir
        self.context = zmq.Context()
        try:
            self._open(cfg, run_dir, policy)
        except BaseException:
            if getattr(self, "auth", None) is not None:
                self.auth.stop()
            self.context.destroy(linger=0)  # closes whichever socket was already open
            raise

    def _open(self, cfg: Config, run_dir: Path, policy: torch.nn.Module) -> None:
        from tandem.transport.auth import open_to_strangers, start_server_auth
        from tandem.transport.channel import GroupReceiver
        from tandem.transport.weights import new_run_id, weight_publisher

        p = cfg.pipeline
        self.auth = None
        self.auth = start_server_auth(self.context, p.curve)
        self.run_id = new_run_id()
        self.receiver = GroupReceiver(
            f"tcp://{p.bind_host}:{p.data_port}",
            max_bytes=p.max_message_mb * 2**20,
            rcvhwm=p.recv_hwm,
            context=self.context,
            curve=p.curve,
            auth=self.auth,
            limits=group_limits(cfg, policy),
        )
        self.publisher = weight_publisher(p, run_dir, self.run_id, self.context, self.auth)
        self.version = self.first_version = _next_version(run_dir)
        self.resumed: tuple[int, int] | None = None  # (checkpoint's version, our first): load_state_dict
        self.dropped: Counter[str] = Counter()
        self.batches = 0  # batches of groups taken by this trainer process
        self._schedule = (0, 0, 1)  # (version at step 0, step of the next take, steps per batch)
        self.stepped_since_publish = False  # the trainer's weights are past self.version
        self.publish(policy)
        if warning := open_to_strangers(p.bind_host, p.curve):
            log.warning(warning)
        log.info(
            "trainer %s: groups on tcp://%s:%d, weights by %s (version %d); waiting for samplers",
            self.run_id,
            p.bind_host,
            p.data_port,
            self.publisher.where,
            self.version,
        )

    def publish(self, policy: torch.nn.Module) -> float:
        """Publish the policy's weights as `self.version`; returns the seconds it took. The version
        and what it holds (tensor names, bytes) are recorded in RUN/sync_state.json."""
        start = time.perf_counter()
        manifest = self.publisher.publish_version(
            sync_tensors(policy, self.cfg.model.lora.sync),
            version=self.version,
            dtype=self.cfg.pipeline.sync_dtype,
        )
        self.published_bytes = manifest.total_bytes
        state = {
            "version": self.version,
            "total_bytes": manifest.total_bytes,
            "tensors": [t.name for t in manifest.tensors],  # LoRA sync=adapter: the adapters only
        }
        atomic_write_text(self.run_dir / SYNC_STATE_FILE, json.dumps(state), fsync=False)
        return time.perf_counter() - start

    def expect(self, step: int, steps: int, steps_per_batch: int) -> None:
        """Tell samplers when the next batches are taken: the one taken at `step` trains for `steps`
        optimizer steps (0 before the first), each later one for `steps_per_batch`. A sampler paces
        itself by this (`Sampler.remaining`), so it makes only groups that will still be fresh
        when they are taken, however many versions a batch spans."""
        base = version_base(self.version, step, self.cfg.pipeline.sync_every)
        self._schedule = (base, step + steps, max(1, steps_per_batch))
        self._announce()

    def _announce(self) -> None:
        """Publish the versions at which batches `self.batches`, +1, ... will be taken, as far as
        a sampler holding our newest version could make groups for (staleness included)."""
        p = self.cfg.pipeline
        takes = announce(
            *self._schedule, version=self.version, sync_every=p.sync_every, max_staleness=p.max_staleness
        )
        self.publisher.set_status(batches=self.batches, take_versions=takes)

    def weights_version(self) -> int | None:
        """The version of the weights the trainer holds now; None after a step that published none
        (sync_every > 1): those weights are no version a sampler holds."""
        return None if self.stepped_since_publish else self.version

    def on_step(self, policy: torch.nn.Module, step: int) -> dict:
        evals = self.received_evals()
        self.stepped_since_publish = not publishes_at(step, self.cfg.pipeline.sync_every)
        if self.stepped_since_publish:
            return evals
        self.version += 1
        self._announce()  # before the new version is visible: its pacing horizon comes first
        stats = {"sync_seconds": self.publish(policy), "sync_megabytes": self.published_bytes / 1e6}
        # zmq: versions lent (same host) and sent as chunks
        return {**stats, **self.publisher.stats(), **evals}

    def received_evals(self) -> dict:
        """The samplers' held-out evaluations that arrived since the last row: the newest one's eval_*
        fields, and version 0's as eval_*_initial (evaluation.row_fields)."""
        evals = list(self.receiver.evals)
        self.receiver.evals.clear()
        return row_fields([(e["policy_version"], e["fields"]) for e in evals])

    def next_groups(
        self, num_groups: int, keep_alive: Callable[[], None] | None = None
    ) -> tuple[list[Group], dict]:
        """The next `num_groups` fresh groups, waiting for samplers as long as it takes (or
        `pipeline.data_timeout_s`); `keep_alive` is called now and then meanwhile (the other
        ranks of a distributed trainer wait in a collective that must not time out)."""
        p = self.cfg.pipeline
        start = last_arrival = next_warning = last_alive = time.monotonic()
        next_warning += p.data_warn_s
        alive_every = min(KEEP_ALIVE_S, self.cfg.training.dist_timeout_s / 4)
        groups: list[Group] = []
        dropped = Counter()
        starved = False
        while len(groups) < num_groups:
            group = self.receiver.recv(timeout=0.25)
            now = time.monotonic()
            if keep_alive is not None and now - last_alive >= alive_every:
                keep_alive()
                last_alive = now
            if group is None:
                if not starved and now - last_arrival > STARVED_AFTER_S:
                    starved = True
                    self.publisher.set_status(starved=True)
                if now >= next_warning:
                    next_warning = now + p.data_warn_s
                    log.warning(self._no_data_message(now - last_arrival, len(groups), num_groups))
                if p.data_timeout_s and now - last_arrival > p.data_timeout_s:
                    raise TimeoutError(self._no_data_message(now - last_arrival, len(groups), num_groups))
                continue
            last_arrival = now
            reason = drop_reason(self.version, group.policy_version, p.max_staleness, self.resumed)
            if reason is not None:
                dropped[reason] += 1  # stale, discarded by our resume, or from a run that was lost
            else:
                groups.append(group)
        if starved:
            self.publisher.set_status(starved=False)
        self.batches += 1  # announced with the steps this batch makes (`expect`)
        self.dropped.update(dropped)
        return groups, self._stats(groups, dropped, time.monotonic() - start)

    def _no_data_message(self, seconds: float, have: int, need: int) -> str:
        p = self.cfg.pipeline
        refused = self.auth.summary() if self.auth is not None else None
        refused = f"{refused}. Or: " if refused is not None else ""  # the likelier reason: first
        return (
            f"no group has arrived for {seconds:.0f} s ({have} of the {need} this step needs): {refused}is a "
            f"sampler running and pointed here? start one with `tandem sample CONFIG --trainer-host <this host> "
            f"--data-port {p.data_port} --sync-port {p.sync_port}`"
        )

    def _stats(self, groups: list[Group], dropped: Counter, waited: float) -> dict:
        stats = {
            # the sampler's time for the groups of this batch (each carries its share of its
            # generation batch); it overlaps the trainer's own time, unlike colocated runs. A phase
            # no group reported (a sampler that predates `timings`) is left out, not written as 0 s.
            **{
                f"time_{name}": sum(g.timings.get(name, 0.0) for g in groups)
                for name in GROUP_TIMINGS
                if any(name in g.timings for g in groups)
            },
            "wait_seconds": waited,
            **(filtered_fields(groups) if self.cfg.grpo.dynamic_sampling else {}),
            "groups_dropped_stale": dropped["stale"],
            "groups_dropped_future": dropped["future"],
            "groups_dropped_discarded": dropped["discarded"],
            "messages_dropped": sum(self.receiver.dropped.values()),
            "connections_closed": self.receiver.connections_closed,  # oversize frames among them
            # well-formed groups this run cannot train on (transport/admission.py), by reason
            "groups_rejected": sum(self.receiver.rejected.values()),
            **{f"groups_rejected_{reason}": n for reason, n in sorted(self.receiver.rejected.items())},
        }
        for sampler_id, count in self.receiver.received.items():
            stats[f"groups_from_{sampler_id}"] = count
        if self.auth is not None:
            stats["auth_refused"] = self.auth.refused
        return stats

    def state_dict(self) -> dict:
        return {"policy_version": self.version}

    def age(self, group: Group) -> int:
        """Versions behind ours, counted along the lineage this trainer continues (pacing.age)."""
        behind = age(self.version, group.policy_version, self.resumed)
        return behind if behind is not None else self.version - group.policy_version

    def load_state_dict(self, state: dict) -> None:
        """Our version comes from sync_state.json (it must stay ahead of every published one); the
        checkpoint's says which published weights the resume threw away."""
        if "policy_version" in state and int(state["policy_version"]) < self.first_version:
            self.resumed = (int(state["policy_version"]), self.first_version)
        if self.resumed is not None and self.resumed[0] + 1 < self.first_version:
            log.info(
                "resumed at version %d: groups made by versions %d..%d (weights after the checkpoint) are dropped",
                self.first_version,
                self.resumed[0] + 1,
                self.first_version - 1,
            )

    def close(self, *, finished: bool) -> None:
        if finished:
            # stay up until every sampler seen lately has heard it (one busy generating asks
            # between batches), so a standalone `tandem sample` ends instead of waiting for us
            self.publisher.set_status(finished=True)
            deadline = time.monotonic() + FINISH_LINGER_S
            while self.publisher.untold() and time.monotonic() < deadline:
                time.sleep(0.1)
        self.publisher.close()
        self.receiver.close()
        if self.auth is not None:
            self.auth.stop()
        self.context.term()


def group_limits(cfg: Config, policy: torch.nn.Module) -> GroupLimits:
    """What a group must respect to be trained on: the policy's vocabulary and context (its HF
    config), the run's group size and completion length (an agent run's: its episode budget)."""
    config = policy.config
    length, key = cfg.completion_tokens
    return GroupLimits(
        vocab_size=int(config.vocab_size),
        num_generations=cfg.sampling.num_generations,
        max_new_tokens=length,
        max_positions=int(getattr(config, "max_position_embeddings", None) or 2**20),
        length_key=key,
    )


def _next_version(run_dir: Path) -> int:
    path = run_dir / SYNC_STATE_FILE
    if not path.is_file():
        return 0
    return int(json.loads(path.read_text())["version"]) + 1
