"""The sampler process (`tandem sample`): generate scored groups and PUSH them to the trainer.

One loop, one batch of prompts at a time:

1. Ask the trainer for its status (weight version, run id, starved, finished). A newer version,
   or a restarted trainer, is fetched and loaded before the next batch: weights change only
   between generation batches, never inside one, and a sampler that starts late or restarts
   fetches the latest version before it samples anything.
2. Pace: the trainer announces its schedule in that status: it has taken B batches, and will take
   the next ones while holding versions v_B, v_B+1, ... (one batch can span several versions, with
   several optimizer steps per batch or `num_iterations` > 1; several batches can share one, with
   sync_every above the steps per batch). Groups made with version K are fresh until the trainer
   passes K + max_staleness, so a sampler holding K may have made, since it joined at batch B0,
   Q x (B - B0 + #{next takes at versions <= K + max_staleness}) groups, with
   Q = ceil(prompts_per_step / num_samplers) its share of a batch (the rules: transport/pacing.py).
   At that quota it waits for the next version (0 staleness: strictly on-policy, it makes each batch
   with the weights that will train on it). A trainer that reports itself starved (a sampler died,
   or the shares are uneven) lifts the quota, so the pipeline never deadlocks.
3. Generate, score and PUSH the groups (blocking on the high-water mark: a slow trainer makes
   this sampler wait, nothing is dropped). A finished trainer ends the loop; a silent one is
   waited for (and reported), up to `pipeline.trainer_timeout_s` when that is set. A trainer that
   refuses this sampler's handshake (CURVE keys that do not match) is reported as such, with the
   settings to fix, every SILENT_WARN_S seconds until the keys match.

Each sampler appends one JSON line per batch to `<run_dir>/samplers/<sampler_id>.jsonl` and
keeps its place in the prompt stream in `<sampler_id>.state.json` there, so a restarted sampler
continues with new prompts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import statistics
import time
import zlib

import torch
import zmq

from tandem.atomic import atomic_write_text
from tandem.config import Config
from tandem.data.stream import prompt_stream
from tandem.distributed.runtime import gpu_memory, resolve_device, set_seed, set_threads, use_device
from tandem.models.loading import load_tokenizer
from tandem.models.lora import adapter_parameters, is_lora
from tandem.rewards.calling import RewardError
from tandem.sampler.dynamic import GroupFilter, max_extra_prompts
from tandem.sampler.evaluation import Evaluator
from tandem.sampler.rollout import build_rollout
from tandem.transport.channel import GroupSender
from tandem.transport.pacing import batch_share, groups_allowed
from tandem.transport.weights import WeightSyncError, weight_source
from tandem.types import TrainerStatus

log = logging.getLogger(__name__)

POLL_S = 1.0  # long-poll slice while waiting for the trainer
STARVED_GRACE_S = 5.0  # at quota, wait this long for new weights before honouring `starved`
SILENT_WARN_S = 30.0


def default_sampler_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class TrainerGone(RuntimeError):
    """The trainer did not answer for `pipeline.trainer_timeout_s` seconds."""


class Sampler:
    def __init__(self, cfg: Config, *, sampler_id: str, device: str = "auto") -> None:
        p = cfg.pipeline
        self.cfg, self.sampler_id = cfg, sampler_id
        salt = zlib.crc32(sampler_id.encode())  # samplers of one run see different prompts and samples
        set_seed(cfg.seed + salt)
        set_threads(cfg.sampling.num_threads)
        self.device = resolve_device(device)
        use_device(self.device, tf32=cfg.training.tf32)  # the trainer's matmul precision, as it scores
        tokenizer = load_tokenizer(
            cfg.model.tokenizer or cfg.model.policy, trust_remote_code=cfg.model.trust_remote_code
        )
        generator = torch.Generator(device="cpu").manual_seed(cfg.seed * 7919 + salt)
        self.rollout = build_rollout(cfg, None, tokenizer, generator, self.device, sampler_id=sampler_id)
        # eval.*: this sampler evaluates the versions it loads (one sampler of a run does)
        evaluates = cfg.eval.steps > 0 and sampler_id == cfg.eval.sampler_id
        self.evaluator = Evaluator(cfg, self.rollout) if evaluates else None
        self.batch_prompts = max(1, cfg.sampling.batch_size // cfg.sampling.num_generations)
        self.stream = prompt_stream(cfg.data, self.batch_prompts, seed=cfg.seed, stream_seed=cfg.seed + salt)
        self.log_dir = cfg.run_dir / "samplers"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.log_dir / f"{sampler_id}.state.json"
        self.share = batch_share(cfg.prompts_per_step, p.num_samplers)  # Q above
        # grpo.dynamic_sampling: zero-variance groups are replaced before they are sent (dynamic.py)
        self.filter = (
            GroupFilter(self.share, max_extra_prompts(cfg, p.num_samplers))
            if cfg.grpo.dynamic_sampling
            else None
        )
        if self.state_path.is_file():
            state = json.loads(self.state_path.read_text())
            self.stream.load_state_dict(state["data"])
            if self.filter is not None and "filter" in state:
                self.filter.load_state_dict(state["filter"])

        self.context = zmq.Context()
        self.data_address = f"tcp://{p.trainer_host}:{p.data_port}"
        self.sender = GroupSender(self.data_address, sndhwm=p.send_hwm, context=self.context, curve=p.curve)
        self.weights = weight_source(p, cfg.run_dir, self.context)

        self.version = -1  # the weights the rollout policy holds; -1 = none from the trainer yet
        self.run_id: str | None = None
        self.schedule: TrainerStatus | None = None  # the trainer's newest status
        self.first_batch = 0  # batches the trainer had taken when this sampler joined its run
        self.made = 0  # groups made since then
        self.sent = 0
        self._silent_since: float | None = None
        self._last_warning = 0.0
        self._told_refusal: str | None = None  # the handshake problem last reported
        self._last_refusal_warning = 0.0
        self.time_engine_load = 0.0  # vLLM: the last version's load into the engine (in time_weights)

    @property
    def trainer_where(self) -> str:
        return f"{self.data_address} ({self.weights.where})"

    # ------------------------------------------------------------------ trainer status

    def _status(self, *, newer_than: int | None = None, wait_s: float = 0.0) -> TrainerStatus | None:
        status = self.weights.status(newer_than=newer_than, run_id=self.run_id, wait_s=wait_s, timeout_s=5.0)
        now = time.monotonic()
        if status is not None and status.version >= 0:
            self._silent_since = None
            if status.run_id == self.run_id:
                self.schedule = status
            return status
        self._silent_since = self._silent_since or now
        silent = now - self._silent_since
        refused = self._refused() if status is None else None
        if refused is None and now - self._last_warning >= SILENT_WARN_S:
            self._last_warning = now
            what = "has published no weights yet" if status is not None else "does not answer"
            log.warning(
                "sampler %s: the trainer at %s %s (%.0f s); waiting. Is `tandem train` running there "
                "with the same pipeline ports and sync_method?",
                self.sampler_id,
                self.trainer_where,
                what,
                silent,
            )
        limit = self.cfg.pipeline.trainer_timeout_s
        if limit and silent > limit:
            if refused is not None:
                raise TrainerGone(f"refused for {silent:.0f} s (pipeline.trainer_timeout_s): {refused}")
            raise TrainerGone(
                f"no trainer at {self.trainer_where} for {silent:.0f} s (pipeline.trainer_timeout_s)"
            )
        if status is None and newer_than is None:
            time.sleep(min(POLL_S, 0.2))  # zmq timed out already; fs returns at once
        return None

    def _refused(self) -> str | None:
        """Why the trainer refuses this sampler's handshakes (CURVE keys), or None: said at once,
        then every SILENT_WARN_S seconds for as long as it lasts."""
        # both asked: each check also lets its socket try again
        problems = [self.weights.handshake_problem(), self.sender.handshake_problem()]
        problem = next(filter(None, problems), None)
        now = time.monotonic()
        if problem is not None:
            p = self.cfg.pipeline
            problem += (
                f". `tandem check-comm connect --trainer-host {p.trainer_host} --data-port {p.data_port} "
                f"--sync-port {p.sync_port}` (with --config CONFIG for the keys) checks both channels"
            )
        if problem is None:
            if self._told_refusal is not None:
                log.info("sampler %s: the trainer accepts this sampler's handshake now", self.sampler_id)
            self._told_refusal = None
            return None
        if problem != self._told_refusal or now - self._last_refusal_warning >= SILENT_WARN_S:
            self._told_refusal, self._last_refusal_warning = problem, now
            log.warning("sampler %s: %s", self.sampler_id, problem)
        return problem

    def wait_for_turn(self) -> TrainerStatus | None:
        """Block until this sampler may generate a batch; None when the trainer has finished."""
        at_quota_since: float | None = None
        while True:
            at_quota = self.remaining() <= 0 and self.version >= 0
            status = self._status(
                newer_than=self.version if at_quota else None, wait_s=POLL_S if at_quota else 0
            )
            if status is None:
                continue
            if status.finished:
                return None
            if status.run_id != self.run_id or status.version > self.version:
                return status  # new weights (or a restarted trainer): fetch them first
            if not at_quota or self.remaining() > 0:  # (the trainer may have announced more takes)
                return status
            at_quota_since = at_quota_since or time.monotonic()
            if status.starved and time.monotonic() - at_quota_since >= STARVED_GRACE_S:
                log.info(
                    "sampler %s: trainer starved at version %d: making more", self.sampler_id, status.version
                )
                return status

    def update_weights(self, status: TrainerStatus) -> float | None:
        """Fetch and load the newest weights; the seconds it took, or None when it failed (the
        trainer went away, pruned that version, or sent a bad reply: the next status says what now)."""
        start = time.perf_counter()
        policy = self.rollout.policy
        params = adapter_parameters(policy) if is_lora(policy) else None
        try:
            manifest = self.weights.load_newest(policy, params, status)
        except WeightSyncError as err:  # a bad reply costs this attempt only; the next status retries
            log.warning("sampler %s: %s; asking the trainer again", self.sampler_id, err)
            return None
        if manifest is None:
            return None
        if self.rollout.engine is not None:  # sampling.backend=vllm: into the running engine
            self.time_engine_load = self.rollout.engine.load_weights(policy)
        if manifest.run_id != self.run_id:
            log.info(
                "sampler %s: trainer run %s, weights v%d", self.sampler_id, manifest.run_id, manifest.version
            )
            self.first_batch, self.made = status.batches, 0
        self.version, self.run_id = manifest.version, manifest.run_id
        self.schedule = status if status.run_id == manifest.run_id else None
        seconds = time.perf_counter() - start
        if self.evaluator is not None and self.evaluator.due(self.version):
            self.evaluate()
        return seconds

    def evaluate(self) -> None:
        """The held-out evaluation of the version loaded now, sent to the trainer (it logs it in its
        next row); the sampler makes no groups meanwhile."""
        fields = self.evaluator.run(self.version)
        log.info(
            "sampler %s: evaluated v%d in %.1f s: accuracy %s",
            self.sampler_id,
            self.version,
            fields["eval_seconds"],
            fields["eval_accuracy"],
        )
        try:
            self.sender.send_eval(self.sampler_id, self.version, fields, timeout=POLL_S * 5)
        except TimeoutError as err:
            log.warning(
                "sampler %s: the evaluation of v%d was not sent: %s", self.sampler_id, self.version, err
            )

    def remaining(self) -> int:
        """Groups this sampler may still make before it waits for newer weights (pacing, above)."""
        if self.schedule is None or self.version < 0:
            return 0
        allowed = groups_allowed(
            self.schedule, self.version, self.first_batch, self.share, self.cfg.pipeline.max_staleness
        )
        return allowed - self.made

    def prompts_to_make(self) -> int:
        """Prompts of the next generation batch: this sampler's remaining quota, at most a batch.

        With dynamic sampling some groups will be dropped, so it makes quota / (kept fraction so far)
        prompts, still at most a batch: a surplus counts towards its next share (pacing holds it
        back meanwhile). Not with max_staleness 0, where a surplus group could only arrive stale."""
        n, remaining = self.batch_prompts, self.remaining()
        if remaining <= 0:  # at or past the quota only when the trainer is starved
            return n
        if self.filter is not None and self.cfg.pipeline.max_staleness > 0 and self.filter.generated_total:
            kept = 1 - self.filter.filtered_total / self.filter.generated_total
            remaining = math.ceil(remaining / max(kept, 0.25))
        return min(n, remaining)

    # ------------------------------------------------------------------ main loop

    def send(self, group) -> bool:
        """PUSH one group, waiting while the trainer is busy; False once the trainer has finished."""
        while True:
            try:
                self.sender.send(group, timeout=POLL_S * 5)
                return True
            except TimeoutError:
                self._refused()  # the data channel alone may be refused (weights by files)
                status = self._status()
                if status is not None and status.finished:
                    return False

    def run(self, max_batches: int | None = None) -> int:
        """Sample until the trainer finishes; returns the number of groups sent."""
        log.info(
            "sampler %s: trainer %s, %d prompt(s) x %d per batch, %d group(s) per version",
            self.sampler_id,
            self.trainer_where,
            self.batch_prompts,
            self.cfg.sampling.num_generations,
            self.share,
        )
        batches = 0
        with (self.log_dir / f"{self.sampler_id}.jsonl").open("a") as record:
            while max_batches is None or batches < max_batches:
                wait_start = time.perf_counter()
                self.time_engine_load = 0.0
                status = self.wait_for_turn()
                if status is None:
                    break
                time_weights = 0.0
                if status.run_id != self.run_id or status.version > self.version:
                    time_weights = self.update_weights(status)
                    if time_weights is None or self.remaining() <= 0:
                        continue  # the fetch failed, or nothing to make yet: ask again
                time_wait = time.perf_counter() - wait_start - time_weights
                n = self.prompts_to_make()
                try:
                    made = self.rollout.run(self.stream.next_batch(n), policy_version=self.version)
                except RewardError as err:  # the user's reward code: loud, with its traceback, then stop
                    log.error("sampler %s: stopping: %s", self.sampler_id, err, exc_info=err)
                    raise
                groups = made if self.filter is None else self.filter.admit(made)
                self.made += len(groups)
                send_start = time.perf_counter()
                finished = False
                for group in groups:
                    if not self.send(group):
                        finished = True
                        break
                    self.sent += 1
                state = {"data": self.stream.state_dict()}
                if self.filter is not None:
                    state["filter"] = self.filter.state_dict()
                atomic_write_text(self.state_path, json.dumps(state), fsync=False)
                batches += 1
                row = self._row(groups, time_wait, time_weights, send_start)
                if self.filter is not None:
                    row.update(groups_generated=len(made), groups_filtered=len(made) - len(groups))
                record.write(json.dumps(row) + "\n")
                record.flush()
                if finished:
                    break
        log.info("sampler %s: trainer finished; sent %d group(s)", self.sampler_id, self.sent)
        return self.sent

    def _row(self, groups, time_wait: float, time_weights: float, send_start: float) -> dict:
        t = self.rollout.timings
        completions = [c for g in groups for c in g.completions]
        tokens = sum(len(c.generated_token_ids) for c in completions)
        scored = [c.reward for c in completions if c.scored]
        return {
            "time": time.time(),
            "sampler_id": self.sampler_id,
            "policy_version": self.version,
            "groups": len(groups),
            "groups_sent_total": self.sent,
            "reward_mean": statistics.fmean(scored) if scored else None,  # over the scored completions
            "tokens_generated": tokens,
            "time_generate": t.generate,
            "time_reference": t.reference,
            "time_reward": t.reward,
            "generate_tokens_per_second": tokens / max(t.generate, 1e-9),
            "time_weights": time_weights,
            "time_weights_engine": self.time_engine_load if self.rollout.engine is not None else None,
            **(self.rollout.engine_gap or {}),
            "time_wait_trainer": time_wait,
            "time_send": time.perf_counter() - send_start,
            **gpu_memory(),  # on CUDA: this sampler's own memory (beside the trainer's on a shared GPU)
        }

    def close(self) -> None:
        if self.rollout.engine is not None:
            self.rollout.engine.close()
        self.sender.close()
        self.weights.close()
        self.context.term()


def run_sampler(cfg: Config, *, sampler_id: str | None = None, device: str = "auto") -> int:
    sampler = Sampler(cfg, sampler_id=sampler_id or default_sampler_id(), device=device)
    try:
        return sampler.run()
    finally:
        sampler.close()
