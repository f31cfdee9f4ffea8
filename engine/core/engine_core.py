"""EngineCore: the synchronous engine, one step at a time.

It ties the scheduler, the KV pool, the model runner, the sampler and the
detokenizers together. The trio actors drive the same pieces from separate
tasks (the scheduler's ``propose`` / ``finalize`` around one KV-pool round
trip, the runner's ``execute``, then ``process_output``); this facade runs
them in a row for offline use and tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.config import EngineConfig
from trioserve.engine.text.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from trioserve.engine.errors import InvalidRequestError, TokenizerError
from trioserve.engine.faults import Fault
from trioserve.engine.sampling.grammar import FilledMask, GrammarCompiler, GrammarError, GrammarMatchers, MaskFill, MaskRequest
from trioserve.engine.heap_trim import trim_heap
from trioserve.engine.core.kv_budget import KVPoolPlan, available_memory, plan_pool
from trioserve.engine.layers.kv_cache import KVCache, kv_bytes_per_block
from trioserve.engine.kernels.kv_dtype_choice import KVDtypeChoice, refuse_before_load
from trioserve.engine.loading.loader import LoadedModel, load_model_for, resolve_device
from trioserve.engine.runtime.build import build_runner, kv_dtype_choice
from trioserve.engine.runtime.model_runner import ModelRunner, RunnerOutput
from trioserve.engine.core.outputs import RequestOutput, RequestTimes
from trioserve.engine.plugins import PluginError, Plugins
from trioserve.engine.core.new_request import NewRequest, check_priority, check_request_id
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.scheduler import Scheduler, SchedulerOutput
from trioserve.engine.core.scheduling_policy import scheduling_policy
from trioserve.engine.core.sequence import FinishReason, Request, RequestStatus
from trioserve.engine.sampling.speculative import speculative_proposer
from trioserve.engine.sampling.rows import TokenMask
from trioserve.engine.text.tokenizer import apply_chat_template, check_text

if TYPE_CHECKING:
    from trioserve.engine.parallel.tp_runner import TPRunner

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]



def kv_pool_plan(config: EngineConfig, loaded: LoadedModel, kv_dtype: KVDtypeChoice) -> KVPoolPlan:
    """The KV pool's size from ``config.kv_cache_memory`` (engine/core/kv_budget.py)."""
    # The model's own config: under tensor parallelism, one rank's KV heads.
    per_block = kv_bytes_per_block(loaded.model.config, config.block_size, kv_dtype.dtype)
    budget = config.kv_cache_memory
    free = 0
    if not isinstance(budget, int):  # a fraction, or a default that depends on what is free
        if loaded.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(loaded.device)
        else:
            free = available_memory()
    per_sequence = config.blocks_per_sequence(loaded.model_config)
    plan = plan_pool(
        budget,
        device_type=loaded.device.type,
        free_memory=free,
        bytes_per_block=per_block,
        block_size=config.block_size,
        blocks_per_sequence=per_sequence,
        max_num_seqs=config.max_num_seqs,
        dtype=kv_dtype.name,
    )
    if plan.num_blocks < per_sequence:
        # A pool smaller than one full context could refuse requests the
        # model accepts; say so instead of failing later.
        log.warning(
            "KV pool of %d blocks holds less than one max_model_len context (%d blocks)", plan.num_blocks, per_sequence
        )
    return plan



@attrs.define(eq=False)
class _Completion:
    """Engine-side bookkeeping of one of a request's ``n`` completions."""

    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    first_scheduled: float | None = None
    first_token: float | None = None
    admitted: float = attrs.field(factory=time.monotonic)
    preemptions: tuple[float, ...] = ()


class EngineCore:
    """The engine as a plain object: add requests, call ``step()``, read outputs."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        runner: bool = True,
        kv_dtype: KVDtypeChoice | None = None,
    ) -> None:
        """``runner=False``: no KV tensors and no runner here (the model step
        runs in a worker process that builds its own, of ``num_blocks``
        blocks); the core then only plans and reports. ``kv_dtype``: the
        cache dtype already chosen for ``loaded`` (replicas sharing one
        model take one choice), else chosen here from ``config.kv_cache_dtype``."""
        self.config = config
        self.loaded = loaded
        self.model_config = loaded.model_config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = config.resolved_max_model_len(loaded.model_config)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide: the step is the only heavy user
        # What the KV cache stores and how many blocks it gets, and why
        # (engine/kernels/kv_dtype_choice.py, engine/core/kv_budget.py; shown in /version).
        self.kv_dtype = kv_dtype_choice(config, loaded) if kv_dtype is None else kv_dtype
        self.kv_pool = kv_pool_plan(config, loaded, self.kv_dtype)
        log.info("%s: KV cache in %s; pool of %s", loaded.name, self.kv_dtype, self.kv_pool)
        num_blocks = self.kv_pool.num_blocks
        self.num_blocks = num_blocks
        # The KV pool: this core's, whoever drives it. Every change reaches
        # it as one ``KVBatch`` (the scheduler's ``propose``) answered by one
        # ``KVResult`` (``finalize``): applied here by ``schedule()`` and
        # ``step()`` in process, or by the allocator actor, which serves
        # this same pool, on the actors' path (actors/allocator.py). A
        # CPU pool commits a block's memory when it is first written, so
        # written blocks are reused first (engine/core/block_manager.py).
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            reuse_written_first=loaded.device.type == "cpu",
        )
        # Plugins by entry-point name; an unknown one stops here (engine/plugins.py).
        self.plugins = Plugins.load(config.plugins)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_blocks=num_blocks,
            block_size=config.block_size,
            aging_interval=config.priority_aging_steps,
            proposer=speculative_proposer(config),
            policy=scheduling_policy(self.plugins, config),
        )
        self.runner: ModelRunner | TPRunner | None = None
        if runner:
            self.runner = build_runner(loaded, config, num_blocks, self.plugins, self.kv_dtype)
        self.kv_cache: KVCache | None = None if self.runner is None else self.runner.kv_cache
        if self.runner is not None and config.tensor_parallel_size > 1:
            from trioserve.engine.parallel.tp_runner import tensor_parallel_runner  # torch.distributed only when asked for

            # Rank 0's runner, driving the other ranks.
            self.runner = tensor_parallel_runner(self.runner)
        self._completions: dict[str, _Completion] = {}  # by child request id
        self._children: dict[str, tuple[str, ...]] = {}  # request id -> its completions' ids
        self._ended: list[Request] = []  # ended between steps, final output not yet reported
        self._held_siblings: dict[str, list[Request]] = {}  # n > 1: completions waiting for the first's prefill
        # Faults of the tokenizer (at admission) and detokenizer (mid-stream):
        # counted, the latest kept, and the detokenizer's failed requests
        # queued for the caller (``take_failures``).
        self.num_tokenizer_errors = 0
        self.num_detokenizer_errors = 0
        self.last_fault: Fault | None = None
        self._failures: dict[str, Exception] = {}  # request id -> the detokenizer's (or grammar's) error
        # Structured output: compiled grammars (cached) and each constrained
        # sequence's matcher; _grammar_dead holds sequences ended because
        # their grammar allowed no token, whose token this step is dropped.
        self.grammars = GrammarMatchers(
            GrammarCompiler(
                loaded.tokenizer,
                loaded.model_config.vocab_size,
                tuple(loaded.model_config.eos_token_ids),
                cache_size=config.grammar_cache_size,
            )
        )
        self._grammar_dead: set[str] = set()
        # Whether steps ran since the heap was last trimmed, and how many
        # times it was trimmed since the start (``release_memory``).
        self._ran_since_trim = False
        self.num_heap_trims = 0
        # What loading and the warm-up freed goes back before serving starts.
        trim_heap()

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        """Load ``config.model`` (the default model when None) and build an engine on it."""
        refuse_before_load(config.kv_cache_dtype, resolve_device(config.device))
        if config.tensor_parallel_size > 1:
            from trioserve.engine.parallel.tp_runner import start_tensor_parallel

            loaded = start_tensor_parallel(config)
        else:
            loaded = load_model_for(config)
        return cls(loaded, config)

    # -- requests ---------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (templated).

        Raises ``InvalidRequestError`` naming the field; an exception from
        inside the tokenizer becomes ``TokenizerError`` (the request is
        refused, nothing else is affected).
        """
        try:
            return self._tokenize(prompt)
        except InvalidRequestError:
            raise
        except Exception as exc:
            field = "prompt" if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], dict) else "messages"
            raise self._tokenizer_error(f"the tokenizer failed on this request's {field}", field, exc) from exc

    def _tokenizer_error(self, message: str, field: str, exc: Exception) -> TokenizerError:
        # The class name only: the exception's text may quote the prompt,
        # which is never logged or echoed.
        message = f"{message} ({type(exc).__name__})"
        self.num_tokenizer_errors += 1
        self.last_fault = Fault("tokenizer_failed", message)
        log.warning("%s", message)
        return TokenizerError(message, field=field)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", field="prompt")
            check_text(prompt, "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        items = list(prompt)
        if not items:
            raise InvalidRequestError("prompt must not be empty", field="prompt")
        if all(isinstance(item, dict) for item in items):
            return apply_chat_template(self.tokenizer, items, add_generation_prompt=True)
        if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            vocab = self.model_config.vocab_size
            bad = next((t for t in items if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"prompt has token id {bad} outside the vocabulary [0, {vocab})", field="prompt")
            return items
        raise InvalidRequestError("prompt must be a string, a list of token ids or a list of messages", field="prompt")

    def validate(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0
    ) -> NewRequest:
        """Check a request once, at the edge: its id, its prompt (tokenized;
        ids in the vocabulary; short enough to fit with one generated token)
        and its parameters against the vocabulary. Raises
        ``InvalidRequestError`` (or ``RequestTooLongError``,
        ``TokenizerError``) naming the field at fault."""
        check_request_id(request_id)
        check_priority(priority)
        params = params or SamplingParams()
        params.validate_for_vocab(self.model_config.vocab_size)
        if params.structured_output is not None:
            # A dict hit when Engine.prepare compiled it in a worker thread.
            self.grammars.compiler.compile(params.structured_output)
        if params.logits_processors:
            self.plugins.check_logits_processors(params.logits_processors)
        prompt_ids = self.tokenize(prompt)
        self.scheduler.check_fits(len(prompt_ids))
        return NewRequest(request_id, tuple(prompt_ids), params, priority)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[int]:
        """Validate and admit a request; return its prompt token ids.

        Raises ``InvalidRequestError`` (or ``RequestTooLongError``) naming the
        field at fault; nothing is admitted then.
        """
        request = self.validate(request_id, prompt, params, priority=priority)
        self.admit(request, arrival_time=arrival_time)
        return list(request.prompt_token_ids)

    def admit(self, new: NewRequest, *, arrival_time: float | None = None) -> None:
        """Admit a validated request (``validate``). Raises
        ``InvalidRequestError`` only if its id is in use, and
        ``TokenizerError`` if the tokenizer fails on its prompt's tail."""
        request_id, params, prompt_ids = new.request_id, new.params, new.prompt_token_ids
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        eos = self.model_config.eos_token_ids
        children = []
        for index, child_id in enumerate(new.sequence_ids()):
            child_params = params
            if params.n > 1:
                # Each completion is its own sequence; derive distinct seeds so
                # n seeded completions differ but stay reproducible.
                seed = None if params.seed is None else params.seed + index
                child_params = attrs.evolve(params, n=1, seed=seed)
            children.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=list(prompt_ids),
                    sampling_params=child_params,
                    eos_token_ids=eos,
                    priority=new.priority,
                    arrival_time=arrival,
                )
            )
        completions = []
        for index, request in enumerate(children):
            params_i = request.sampling_params
            try:
                # Decodes the prompt's tail: the tokenizer may fail here too.
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    list(prompt_ids),
                    skip_special_tokens=params_i.skip_special_tokens,
                    stop=params_i.stop,
                    include_stop_str_in_output=params_i.include_stop_str_in_output,
                )
            except Exception as exc:
                message = "the tokenizer failed to decode this request's prompt"
                raise self._tokenizer_error(message, "prompt", exc) from exc
            completions.append(_Completion(request=request, parent_id=request_id, index=index, detokenizer=detokenizer))
        # Only the first completion is scheduled now (its id is checked free
        # there, before anything is kept). Its siblings wait until it has
        # computed the prompt, so they find every full prompt block in the
        # prefix cache and share it instead of computing it again.
        self.scheduler.add_request(children[0])
        if len(children) > 1:
            self._held_siblings[request_id] = children[1:]
        for completion in completions:
            self._completions[completion.request.request_id] = completion
            if completion.request.sampling_params.structured_output is not None:
                self.grammars.add(completion.request.request_id, completion.request.sampling_params.structured_output)
        self._children[request_id] = tuple(r.request_id for r in children)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a request (all its completions) now. Its KV blocks go back
        with the next batch, before the next step runs; its final outputs
        come with that step."""
        children = self._children.get(request_id)
        if children is None:
            return False
        found = False
        for child_id in children:
            found |= self.scheduler.finish_request(child_id, reason) is not None
        for held in self._held_siblings.pop(request_id, ()):
            # Never scheduled, so they hold no blocks: end them directly.
            held.status, held.finish_reason = RequestStatus.FINISHED, reason
            self._ended.append(held)
            found = True
        return found

    def pause(self, request_id: str) -> bool:
        """Preempt a request's completions by recompute and keep them out of
        scheduling until ``resume`` (its reader is behind). Their output is
        kept; their blocks go back with the next batch."""
        children = self._children.get(request_id, ())
        return any([self.scheduler.pause(child_id) for child_id in children])

    def resume(self, request_id: str) -> bool:
        """Let a paused request's completions be scheduled again."""
        children = self._children.get(request_id, ())
        return any([self.scheduler.resume(child_id) for child_id in children])

    def is_unscheduled(self, request_id: str) -> bool:
        """Whether nothing has been computed for this request yet: its first
        completion (the one its siblings wait for) has never been scheduled."""
        children = self._children.get(request_id)
        first = self._completions.get(children[0]) if children else None
        return first is not None and first.request.status is RequestStatus.WAITING

    def parent_of(self, child_id: str) -> str | None:
        """The request id a completion's sequence id belongs to."""
        completion = self._completions.get(child_id)
        return None if completion is None else completion.parent_id

    def has_unfinished(self) -> bool:
        return bool(self._children)

    @property
    def num_requests(self) -> int:
        return len(self._children)

    # -- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one step, give the blocks of the
        requests it finished back to the pool, so an idle core holds none,
        and trim the heap when that step left the core idle
        (``release_memory``)."""
        plan = self.schedule()
        outputs = self.process_output(plan, self.execute(plan))
        self._free_finished()
        self.release_memory()
        return outputs

    def release_memory(self) -> bool:
        """Give the heap's free pages back to the system (``heap_trim``)
        when the core is idle and steps ran since the last time; returns
        whether it trimmed. Callers call it when they go idle: a trim takes
        a few milliseconds, never spent inside a step."""
        if self.has_unfinished() or not self._ran_since_trim:
            return False
        self._ran_since_trim = False
        trimmed = trim_heap()
        self.num_heap_trims += trimmed
        return trimmed

    def schedule(self) -> SchedulerOutput:
        """Plan a step in process: one batch applied to the core's pool,
        then the structured-output masks (``attach_masks``). The blocks of
        the requests the masks ended go back at once, and their final
        outputs come with this step. On the actors' path the scheduler
        actor plans instead (``propose``, the allocator actor, ``finalize``)."""
        plan = self.attach_masks(self.scheduler.schedule(self.block_manager))
        self._free_finished()
        return plan

    def _free_finished(self) -> None:
        """In process: give the blocks of finished and aborted requests
        back to the pool now rather than with the next plan; the final
        outputs not yet reported go out with the next ``process_output``."""
        if self.scheduler.has_blocks_to_free():
            freed = self.scheduler.free_finished(self.block_manager)
            self._ended.extend(r for r in freed if r.request_id in self._completions)

    def attach_masks(self, plan: SchedulerOutput) -> SchedulerOutput:
        """``plan`` with the allowed-token bitmask of every constrained row
        that samples this step, filled here and now in one batch (the
        offline ``step()``; the actors fill it while the forward runs:
        ``mask_fill``). A row whose grammar allows no token (with
        ``min_tokens`` still banning EOS, say) ends its request with a
        ``GrammarError`` now: its token this step is dropped."""
        fill = self.mask_fill(plan)
        if fill is None:
            return plan
        return attrs.evolve(plan, plan=attrs.evolve(plan.plan, token_mask=self.mask_filled(fill.run())))

    def mask_fill(self, plan: SchedulerOutput) -> MaskFill | None:
        """The mask work of ``plan``'s constrained rows that sample this
        step, to run on any thread (``MaskFill.run``, then ``mask_filled``);
        None when no row of the plan is constrained."""
        if not len(self.grammars):
            return None
        rows = []
        for chunk in plan.chunks:
            row = chunk.sampling
            if row is None or chunk.request_id not in self.grammars:
                continue
            banned: tuple[int, ...] = ()
            if row.num_output_tokens < row.params.min_tokens:
                banned = (*row.eos_token_ids, *row.params.stop_token_ids)
            rows.append(MaskRequest(chunk.request_id, banned))
        return self.grammars.prepare(rows) if rows else None

    def mask_filled(self, filled: FilledMask) -> TokenMask:
        """End the requests of the rows ``filled`` found dead (a
        ``GrammarError``; their token this step is dropped) and return its mask."""
        for request_id, why in filled.dead:
            self._grammar_failed(request_id, why)
        return filled.mask

    def _grammar_failed(self, request_id: str, why: str) -> None:
        completion = self._completions.get(request_id)
        if completion is None or completion.parent_id in self._failures:
            return
        self._grammar_dead.add(request_id)
        self._failures[completion.parent_id] = GrammarError(f"structured output failed: {why}")
        self.abort(completion.parent_id, FinishReason.ERROR)

    def close(self) -> None:
        """Stop what the core started beside its own thread: the other ranks
        of a tensor-parallel group (tp_runner.py). Idempotent; a core
        without such ranks has nothing to stop."""
        if self.config.tensor_parallel_size > 1 and self.runner is not None:
            self.runner.close()

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if self.runner is None:
            raise RuntimeError("this core has no runner: its model step runs in a worker process")
        return self.runner.execute(plan.plan)

    def process_output(self, plan: SchedulerOutput, output: RunnerOutput) -> list[RequestOutput]:
        """Apply a step's result: append tokens, detokenize, apply stops, report."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        self._ran_since_trim = self._ran_since_trim or bool(plan.chunks)
        # Requests that ended between steps (abort, deadline) report first.
        ended, self._ended = [*self._ended, *plan.finished], []
        for request in ended:
            completion = self._completions.get(request.request_id)
            if completion is not None:
                outputs.append(self._final_output(completion, (), "", (), now))
        for chunk in plan.chunks:
            completion = self._completions.get(chunk.request_id)
            if completion is not None and completion.first_scheduled is None:
                completion.first_scheduled = now
        for request_id in plan.preempted:
            completion = self._completions.get(request_id)
            if completion is not None:
                completion.preemptions += (now,)
        constrained = [rid for rid in output.sampled if rid in self.grammars and self.scheduler.get_request(rid) is not None]
        # A speculating request may append several tokens (engine/sampling/speculative.py).
        before = {rid: r.num_output_tokens for rid in output.extra_tokens if (r := self.scheduler.get_request(rid))}
        finished = {
            r.request_id for r in self.scheduler.update_from_output(plan, output.sampled, output.extra_tokens)
        }
        for request_id in constrained:
            if not self.grammars.accept(request_id, output.sampled[request_id]):
                self._grammar_failed(request_id, f"its grammar refused token {output.sampled[request_id]}")
        if self._held_siblings:
            self._admit_siblings(output.sampled.keys() | finished)
        dead, self._grammar_dead = self._grammar_dead, set()
        for request_id, token_id in output.sampled.items():
            completion = self._completions.get(request_id)
            if completion is None or request_id in dead:
                continue
            if request_id in output.failed:
                self._plugin_failed(completion, output.failed[request_id])
                continue
            if completion.first_token is None:
                completion.first_token = now
            token_ids = (token_id,)
            if request_id in before:
                token_ids = tuple(completion.request.output_token_ids[before[request_id] :])
            try:
                token_ids, delta = self._detokenize(completion, token_ids)
            except Exception as exc:
                self._detokenizer_failed(completion, exc)
                continue
            logprobs = (output.logprobs[request_id],) if request_id in output.logprobs else ()
            if delta.stop_str is not None:
                if request_id in finished:
                    # The same token also reached a length limit: the stop
                    # string wins (its text was cut there), as in vLLM.
                    completion.request.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish_request(request_id, FinishReason.STOP)
                    finished.add(request_id)
            if request_id in finished:
                outputs.append(self._final_output(completion, token_ids, delta.text, logprobs, now, delta.stop_str))
            else:
                outputs.append(self._output(completion, token_ids, delta.text, logprobs, None, None, now))
        if self._failures:
            self._end_failed()
        return outputs

    @staticmethod
    def _detokenize(completion: _Completion, token_ids: tuple[int, ...]) -> tuple[tuple[int, ...], DetokenizerDelta]:
        """Feed a step's tokens to the completion's detokenizer one at a
        time, so a stop string ends the output where plain decoding would:
        the tokens after it are taken off the request's output. Returns the
        tokens kept and their delta."""
        if len(token_ids) == 1:
            return token_ids, completion.detokenizer.add_tokens(token_ids)
        texts = []
        for j, token_id in enumerate(token_ids):
            delta = completion.detokenizer.add_tokens([token_id])
            texts.append(delta.text)
            if delta.stop_str is not None:
                dropped = len(token_ids) - j - 1
                if dropped:
                    request = completion.request
                    del request.output_token_ids[-dropped:]
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                return token_ids[: j + 1], attrs.evolve(delta, text="".join(texts))
        return token_ids, attrs.evolve(delta, text="".join(texts))

    # -- detokenizer faults -----------------------------------------------------

    def _detokenizer_failed(self, completion: _Completion, exc: Exception) -> None:
        if completion.parent_id in self._failures:
            return
        message = f"the detokenizer failed on this request's output ({type(exc).__name__})"
        self.num_detokenizer_errors += 1
        self.last_fault = Fault("detokenizer_failed", message)
        log.warning("request %s: %s", completion.parent_id, message)
        self._failures[completion.parent_id] = exc

    def _plugin_failed(self, completion: _Completion, error: PluginError) -> None:
        """A logits processor raised on this sequence: fail its request
        (as a detokenizer failure does; ``take_failures`` hands it on)."""
        if completion.parent_id in self._failures:
            return
        log.warning("request %s: %s", completion.parent_id, error)
        self._failures[completion.parent_id] = error

    def _end_failed(self) -> None:
        """End every completion of the requests whose detokenizer failed:
        unfinished ones with ``ERROR`` (their final outputs come with the
        next step), finished ones at once (no output)."""
        for parent_id in self._failures:
            if self._children.get(parent_id) is None:
                continue
            self.abort(parent_id, FinishReason.ERROR)
            for child_id in self._children[parent_id]:
                completion = self._completions.get(child_id)
                if completion is None or completion.request.finish_reason in (None, FinishReason.ERROR):
                    continue  # reported already, or its ERROR output comes next step
                self._forget(completion)

    def take_failures(self) -> dict[str, Exception]:
        """The requests whose detokenizer (or logits processor, a
        ``PluginError``) failed since the last call, with its exception.
        Each is ended with ``ERROR`` already (its output stops there); its
        caller should be told."""
        failures, self._failures = self._failures, {}
        return failures

    def _forget(self, completion: _Completion) -> None:
        request_id = completion.request.request_id
        del self._completions[request_id]
        self.grammars.remove(request_id)
        siblings = self._children[completion.parent_id]
        if all(child not in self._completions for child in siblings):
            del self._children[completion.parent_id]

    def _admit_siblings(self, progressed: set[str]) -> None:
        """Schedule the held completions of requests whose first completion
        has computed its prompt (it sampled or finished)."""
        for child_id in progressed:
            completion = self._completions.get(child_id)
            if completion is None or completion.index != 0:
                continue
            for sibling in self._held_siblings.pop(completion.parent_id, ()):
                self.scheduler.add_request(sibling)

    def _final_output(self, completion, token_ids, text, logprobs, now, stop_str=None) -> RequestOutput:
        request = completion.request
        reason = request.finish_reason
        assert reason is not None, f"{request.request_id} reported finished without a reason"
        if stop_str is None and reason is not FinishReason.ERROR:
            try:
                text += completion.detokenizer.finish()
            except Exception as exc:
                self._detokenizer_failed(completion, exc)
        stop_reason: str | int | None = stop_str
        if stop_reason is None and reason is FinishReason.STOP and request.output_token_ids:
            last = request.output_token_ids[-1]
            if last in request.sampling_params.stop_token_ids:
                stop_reason = last
        self._forget(completion)
        return self._output(completion, token_ids, text, logprobs, reason, stop_reason, now)

    def _output(self, completion, token_ids, text, logprobs, reason, stop_reason, now) -> RequestOutput:
        request = completion.request
        return RequestOutput(
            request_id=completion.parent_id,
            index=completion.index,
            new_token_ids=tuple(token_ids),
            text_delta=text,
            logprobs=tuple(logprobs),
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            times=RequestTimes(
                arrival=request.arrival_time,
                first_scheduled=completion.first_scheduled,
                first_token=completion.first_token,
                now=now,
                admitted=completion.admitted,
                preemptions=completion.preemptions,
            ),
        )
