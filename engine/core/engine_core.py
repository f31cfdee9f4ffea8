"""EngineCore: the synchronous engine, one step at a time.

It ties together the scheduler, the KV pool (its own, whoever drives it),
the model runner, the structured-output grammars, and the processors of a
request's input (input_processor.py) and output (output_processor.py). The
trio actors drive the same pieces from separate tasks (the scheduler's
``propose`` / ``finalize`` around one round trip to the allocator actor,
which serves this core's pool; the runner's ``execute``; then
``process_output``); ``step()`` runs them in a row for offline use and tests.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import attrs
import torch

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.input_processor import InputProcessor, Prompt
from trioserve.engine.core.kv_pool import kv_pool_plan, new_pool
from trioserve.engine.core.latency_model import LatencyModel
from trioserve.engine.core.new_request import NewRequest
from trioserve.engine.core.output_processor import Completion, OutputProcessor
from trioserve.engine.core.outputs import RequestOutput
from trioserve.engine.core.scheduler import Scheduler, SchedulerOutput
from trioserve.engine.core.scheduling_policy import scheduling_policy
from trioserve.engine.core.sequence import FinishReason, Request, RequestStatus, completion_requests
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.faults import Fault
from trioserve.engine.heap_trim import trim_heap
from trioserve.engine.kernels.kv_dtype_choice import KVDtypeChoice, refuse_before_load
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.loading.loader import LoadedModel, load_model_for, resolve_device
from trioserve.engine.lora.adapter import LoraAdapter, LoraError, load_adapter
from trioserve.engine.lora.registry import LoraNotFound, LoraRef, serving_registry
from trioserve.engine.models.invariance import lora_invariance
from trioserve.engine.models.projections import ProjectionChoice
from trioserve.engine.plugins import Plugins
from trioserve.engine.runtime.build import build_runner, kv_dtype_choice
from trioserve.engine.runtime.model_runner import ModelRunner, RunnerOutput
from trioserve.engine.sampling.pooling import PooledState, PoolingParams, served_pooling
from trioserve.engine.sampling.grammar import FilledMask, GrammarCompiler, GrammarError, GrammarMatchers, MaskFill, MaskRequest
from trioserve.engine.sampling.rows import TokenMask
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.speculative import speculative_proposer

if TYPE_CHECKING:
    from trioserve.engine.parallel.tp_runner import TPRunner

__all__ = ["EngineCore", "Prompt"]

log = logging.getLogger(__name__)


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
        # An embedding model's pooling (``config.task``); None: it generates.
        self.pooling = served_pooling(config.task, loaded.path)
        if self.pooling is not None:
            _check_embeds(config, loaded)
            log.info("%s: serving embeddings, pooled as %s", loaded.name, self.pooling.source)
        self.max_model_len = config.resolved_max_model_len(loaded.model_config)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide: the step is the only heavy user
        # What the KV cache stores and how many blocks it gets, and why
        # (engine/kernels/kv_dtype_choice.py, engine/core/kv_budget.py; shown in /version).
        self.kv_dtype = kv_dtype_choice(config, loaded) if kv_dtype is None else kv_dtype
        self.kv_pool = kv_pool_plan(config, loaded, self.kv_dtype)
        log.info("%s: KV cache in %s; pool of %s", loaded.name, self.kv_dtype, self.kv_pool)
        self.num_blocks = self.kv_pool.num_blocks
        # The KV pool: this core's, whoever drives it. Every change reaches
        # it as one ``KVBatch`` (the scheduler's ``propose``) answered by one
        # ``KVResult`` (``finalize``): applied here by ``schedule()`` and
        # ``step()`` in process, or by the allocator actor, which serves
        # this same pool, on the actors' path (actors/allocator.py).
        self.block_manager = new_pool(self.num_blocks, config, loaded)
        # Plugins by entry-point name; an unknown one stops here (engine/plugins.py).
        self.plugins = Plugins.load(config.plugins)
        # This engine's step-cost law (issue #44), the one object that SLO
        # admission and the scheduling policy (a plugin's too) predict with,
        # that its driver feeds every step's time and a saved profile seeds.
        self.latency = LatencyModel()
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=config.block_size,
            aging_interval=config.priority_aging_steps,
            proposer=speculative_proposer(config),
            policy=scheduling_policy(self.plugins, config, self.latency),
        )
        self.runner: ModelRunner | TPRunner | None = None
        if runner:
            self.runner = build_runner(loaded, config, self.num_blocks, self.plugins, self.kv_dtype)
        self.kv_cache: KVCache | None = None if self.runner is None else self.runner.kv_cache
        # LoRA adapters (engine/lora): the core's registry, which its runner
        # reads during steps; changed only between steps (``load_lora``).
        self.lora = serving_registry(config, loaded, has_runner=self.runner is not None)
        if self.lora is not None and self.pooling is not None:
            raise ValueError("LoRA adapters serve generation only, not an embedding model (--task embed)")
        if self.lora is not None:
            assert isinstance(self.runner, ModelRunner)
            self.runner.lora = self.lora
            invariance = self.projection_choice.invariance
            log.log(logging.INFO if invariance is None or invariance.invariant else logging.WARNING,
                    "%s: serving LoRA adapters (%d loaded): %s", loaded.name, len(self.lora), invariance)  # fmt: skip
        if self.runner is not None and config.tensor_parallel_size > 1:
            from trioserve.engine.parallel.tp_runner import tensor_parallel_runner  # torch.distributed only when asked for

            # Rank 0's runner, driving the other ranks.
            self.runner = tensor_parallel_runner(self.runner)
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
        self.input_processor = InputProcessor(
            loaded.tokenizer, loaded.model_config.vocab_size, self.grammars, self.plugins, self.scheduler.check_fits
        )
        self.output_processor = OutputProcessor(loaded.tokenizer, self.grammars)
        self._ended: list[Request] = []  # ended between steps, final output not yet reported
        self._held_siblings: dict[str, list[Request]] = {}  # n > 1: completions waiting for the first's prefill
        # Whether steps ran since the heap was last trimmed, and how many
        # times it was trimmed since the start (``release_memory``).
        self._ran_since_trim = False
        self.num_heap_trims = 0
        # What loading and the warm-up freed goes back before serving starts.
        trim_heap()

    @property
    def projection_choice(self) -> ProjectionChoice:
        """How the model runs its projections and whether it is
        batch-invariant, as this core runs it (LoRA changes the latter)."""
        choice = self.loaded.projection_choice
        if self.lora is None or choice.invariance is None:
            return choice
        compressed = choice.quantization is not None
        return attrs.evolve(choice, invariance=lora_invariance(choice.invariance, compressed=compressed))

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

    # -- faults of the tokenizer (at admission) and detokenizer (mid-stream) ---

    @property
    def num_tokenizer_errors(self) -> int:
        return self.input_processor.num_tokenizer_errors

    @property
    def num_detokenizer_errors(self) -> int:
        return self.output_processor.num_detokenizer_errors

    @property
    def last_fault(self) -> Fault | None:
        return Fault.latest(self.input_processor.last_fault, self.output_processor.last_fault)

    # -- requests ---------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (templated);
        see ``InputProcessor.tokenize``."""
        return self.input_processor.tokenize(prompt)

    def validate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        lora: str | None = None,
    ) -> NewRequest:
        """Check a request once, at the edge: its id, its prompt (tokenized;
        ids in the vocabulary; short enough to fit with one generated token)
        and its parameters against the vocabulary. Raises
        ``InvalidRequestError`` (or ``RequestTooLongError``,
        ``TokenizerError``) naming the field at fault. ``pooling`` makes it
        an embedding request, which only an embedding model takes (and it
        takes no other; the error names ``model``). ``lora`` names a loaded
        LoRA adapter to run with (``LoraNotFound`` naming ``model`` else)."""
        if (pooling is None) != (self.pooling is None):
            why = (
                "this model serves embeddings only (the server was started with --task embed): use /v1/embeddings"
                if pooling is None
                else "this model does not serve embeddings: the server was not started with --task embed"
            )
            raise InvalidRequestError(why, field="model")
        new = self.input_processor.validate(request_id, prompt, params, priority)
        if lora is not None:
            new = attrs.evolve(new, lora=self.lora_ref(lora))
        if pooling is None:
            return new
        assert self.pooling is not None
        return attrs.evolve(new, pooling=self.pooling.resolve(pooling, self.model_config.hidden_size))

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> list[int]:
        """Validate and admit a request (``lora``: the adapter it runs
        with, see ``validate``); return its prompt token ids.

        Raises ``InvalidRequestError`` (or ``RequestTooLongError``) naming the
        field at fault; nothing is admitted then.
        """
        request = self.validate(request_id, prompt, params, priority=priority, lora=lora)
        self.admit(request, arrival_time=arrival_time)
        return list(request.prompt_token_ids)

    def admit(self, new: NewRequest, *, arrival_time: float | None = None) -> None:
        """Admit a validated request (``validate``). Raises
        ``InvalidRequestError`` only if its id is in use, and
        ``TokenizerError`` if the tokenizer fails on its prompt's tail."""
        request_id = new.request_id
        if self.output_processor.children(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        if new.lora is not None:
            # Validated while its adapter was loaded; it may have been unloaded since.
            if self.lora is None or self.lora.resolve(new.lora) is None:
                raise InvalidRequestError(f"the LoRA adapter {new.lora.name!r} was unloaded", field="model")
            self.lora.use(request_id, new.lora, self._has_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = completion_requests(new, self.model_config.eos_token_ids, arrival)
        completions = []
        for index, request in enumerate(children):
            try:
                detokenizer = self.output_processor.new_detokenizer(list(new.prompt_token_ids), request)
            except Exception as exc:
                message = "the tokenizer failed to decode this request's prompt"
                raise self.input_processor.tokenizer_error(message, "prompt", exc) from exc
            pooled = None if request.pooling is None else PooledState(request.pooling)
            completions.append(
                Completion(request=request, parent_id=request_id, index=index, detokenizer=detokenizer, pooled=pooled)
            )
        # Only the first completion is scheduled now (its id is checked free
        # there, before anything is kept). Its siblings wait until it has
        # computed the prompt, so they find every full prompt block in the
        # prefix cache and share it instead of computing it again.
        self.scheduler.add_request(children[0])
        if len(children) > 1:
            self._held_siblings[request_id] = children[1:]
        self.output_processor.add(request_id, completions)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a request (all its completions) now. Its KV blocks go back
        with the next batch, before the next step runs; its final outputs
        come with that step."""
        children = self.output_processor.children(request_id)
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

    # -- LoRA adapters (engine/lora), changed between steps only ----------------

    def read_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoraAdapter:
        """Read and check the PEFT adapter at ``path`` for this model (any
        thread; it changes nothing): ``LoraError`` naming the field at fault."""
        if self.lora is None:
            raise LoraError("this engine serves no LoRA adapters (start it with --enable-lora)", field="lora_name")
        return load_adapter(
            name, path, self.model_config, max_rank=self.lora.max_rank, base_model_name=base_model_name,
            device=self.loaded.device,
        )  # fmt: skip

    def lora_ref(self, name: str) -> LoraRef:
        """What a request running adapter ``name`` carries; ``LoraNotFound``
        naming ``model`` unless it is loaded."""
        if self.lora is None:
            raise LoraNotFound(f"{name!r} names a LoRA adapter, but this engine serves none", field="model")
        return self.lora.ref(name)

    def load_lora(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (``read_lora``) from the next step on; between
        steps only. ``LoraError`` naming ``lora_name`` when ``max_loras``
        are loaded or the name is taken."""
        if self.lora is None:
            raise LoraError("this engine serves no LoRA adapters (start it with --enable-lora)", field="lora_name")
        self.lora.add(adapter)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; between steps only.
        ``LoraNotFound`` if it is not loaded, ``LoraInUse`` while requests
        run with it (they are let finish; unload it after)."""
        if self.lora is None:
            raise LoraNotFound(f"no adapter {name!r} is loaded (this engine serves none)", field="lora_name")
        if self.lora.get(name) is None:
            raise LoraNotFound(f"no adapter {name!r} is loaded", field="lora_name")
        self.lora.check_unused(name, self._has_request)
        self.lora.remove(name)

    def _has_request(self, request_id: str) -> bool:
        """Whether request ``request_id`` is admitted and not yet reported ended."""
        return self.output_processor.children(request_id) is not None

    def pause(self, request_id: str) -> bool:
        """Preempt a request's completions by recompute and keep them out of
        scheduling until ``resume`` (its reader is behind). Their output is
        kept; their blocks go back with the next batch."""
        children = self.output_processor.children(request_id) or ()
        return any([self.scheduler.pause(child_id) for child_id in children])

    def resume(self, request_id: str) -> bool:
        """Let a paused request's completions be scheduled again."""
        children = self.output_processor.children(request_id) or ()
        return any([self.scheduler.resume(child_id) for child_id in children])

    def is_unscheduled(self, request_id: str) -> bool:
        """Whether nothing has been computed for this request yet: its first
        completion (the one its siblings wait for) has never been scheduled."""
        children = self.output_processor.children(request_id)
        first = self.output_processor.get(children[0]) if children else None
        return first is not None and first.request.status is RequestStatus.WAITING

    def parent_of(self, child_id: str) -> str | None:
        """The request id a completion's sequence id belongs to."""
        return self.output_processor.parent_of(child_id)

    def has_unfinished(self) -> bool:
        return bool(len(self.output_processor))

    @property
    def num_requests(self) -> int:
        return len(self.output_processor)

    def take_failures(self) -> dict[str, Exception]:
        """The requests whose detokenizer (or logits processor, a
        ``PluginError``, or grammar) failed since the last call, with its
        exception. Each is ended with ``ERROR`` already (its output stops
        there); its caller should be told."""
        return self.output_processor.take_failures()

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
            self._ended.extend(r for r in freed if r.request_id in self.output_processor)

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
        completion = self.output_processor.get(request_id)
        if completion is None:
            return
        if self.output_processor.fail(completion.parent_id, GrammarError(f"structured output failed: {why}")):
            self._grammar_dead.add(request_id)
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
        completions = self.output_processor
        self._ran_since_trim = self._ran_since_trim or bool(plan.chunks)
        # Requests that ended between steps (abort, deadline) report first.
        ended, self._ended = [*self._ended, *plan.finished], []
        outputs = completions.step_started(ended, plan, now)
        completions.add_prompt_logprobs(output.prompt_logprobs)
        completions.add_pooled(output.pooled)
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
            completion = completions.get(request_id)
            if completion is None or request_id in dead:
                continue
            if request_id in output.failed:
                completions.plugin_failed(completion, output.failed[request_id])
                continue
            if completion.first_token is None:
                completion.first_token = now
            token_ids = (token_id,)
            if request_id in before:
                token_ids = tuple(completion.request.output_token_ids[before[request_id] :])
            try:
                token_ids, delta = completions.detokenize(completion, token_ids)
            except Exception as exc:
                completions.detokenizer_failed(completion, exc)
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
                outputs.append(completions.final_output(completion, token_ids, delta.text, logprobs, now, delta.stop_str))
            else:
                outputs.append(completions.output(completion, token_ids, delta.text, logprobs, now))
        for request_id in finished - output.sampled.keys():
            # An embedding request ends with its prompt, its vector pooled.
            completion = completions.get(request_id)
            if completion is not None and completion.pooled is not None:
                outputs.append(completions.final_output(completion, (), "", (), now))
        self._end_failed()
        return outputs

    def _end_failed(self) -> None:
        """End every completion of the requests whose detokenizer failed:
        unfinished ones with ``ERROR`` (their final outputs come with the
        next step), finished ones at once (no output)."""
        for parent_id in self.output_processor.failed():
            children = self.output_processor.children(parent_id)
            if children is None:
                continue
            self.abort(parent_id, FinishReason.ERROR)
            for child_id in children:
                completion = self.output_processor.get(child_id)
                if completion is None or completion.request.finish_reason in (None, FinishReason.ERROR):
                    continue  # reported already, or its ERROR output comes next step
                self.output_processor.forget(completion)

    def _admit_siblings(self, progressed: set[str]) -> None:
        """Schedule the held completions of requests whose first completion
        has computed its prompt (it sampled or finished)."""
        for child_id in progressed:
            completion = self.output_processor.get(child_id)
            if completion is None or completion.index != 0:
                continue
            for sibling in self._held_siblings.pop(completion.parent_id, ()):
                self.scheduler.add_request(sibling)


def _check_embeds(config: EngineConfig, loaded: LoadedModel) -> None:
    """Refuse an embedding model where its hidden states cannot be had:
    tensor parallelism (the ranks' LM-head collectives would no longer
    match) and the transformers fallback (its forward gives logits only)."""
    if config.tensor_parallel_size > 1:
        raise ValueError("--task embed runs with tensor_parallel_size 1 only")
    if type(loaded.model).__name__ == "TransformersForCausalLM":
        raise ValueError(f"--task embed needs a natively run model; {loaded.name} runs on the transformers fallback")
