"""Hooks on vLLM's GPU model runner: the draft's multimodal inputs, report facts, step timing.

Each hook wraps one method of ``GPUModelRunner`` (vLLM's CPU runner inherits them) and acts only
when the runner's drafter is the twin (``TwinDraftProposer`` with ``_twin`` set); otherwise it
defers to vLLM's method. The hooks close over the :class:`~vllm_patch.engine_state.EngineState`
that ``engine_patches.apply`` created.

* ``_gather_mm_embeddings``: for the drafter (the only caller that shifts) the target's tokens are
  gathered unshifted and from the draft's own encoder cache; nothing at all with ``blind_mm``.
* ``_execute_mm_encoder``: after the target's vision tower, the draft's own runs on the same items
  (unless ``blind_mm``, or the towers are equal and shared: ``draft_vision``); its outputs are cached
  beside the target's, keyed by the same hashes.
* ``_get_encoder_output_from_cache``: reads the draft's cache while the drafter gathers.
* ``_update_states``: frees the draft's cached encoder outputs with the target's.
* ``_sample``: tells the relaxed gate which requests the verified rows belong to.
* ``capture_model`` / ``initialize_kv_cache``: what was built goes into the engine report.
* with ``VLLM_SPEC_STEP_TIMING=1``: ``execute_model``, ``_model_forward``,
  ``propose_draft_token_ids`` and ``sample_tokens`` bracket the step timer's spans.
"""

from __future__ import annotations

import torch

from .engine_report import build_facts
from .engine_state import EngineState


def _draft_model_module(drafter):
    model = drafter.model
    unwrap = getattr(model, "unwrap", None)
    return unwrap() if callable(unwrap) else model


def _tp_place() -> tuple[int, int]:
    """(rank, size) of this worker in its tensor-parallel group; (0, 1) when there is no group."""
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except (AssertionError, AttributeError, RuntimeError):  # no group initialised
        return 0, 1


def _twin_drafter(runner):
    """The runner's drafter where it is the twin (``TwinDraftProposer`` with ``_twin`` set), else None."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or getattr(drafter, "_twin", None) is None:
        return None
    return drafter


def _install_mm_hooks(runner_cls, gmr, state: EngineState) -> None:
    """The draft's multimodal inputs: its own encoder outputs, cached beside the target's, read unshifted."""
    knobs = state.knobs
    orig_gather = runner_cls._gather_mm_embeddings
    orig_encoder = runner_cls._execute_mm_encoder
    orig_from_cache = runner_cls._get_encoder_output_from_cache
    orig_update_states = runner_cls._update_states

    def _gather_mm_embeddings(self, scheduler_output, shift_computed_tokens=0):
        drafter = _twin_drafter(self)
        if drafter is None or shift_computed_tokens != 1:
            return orig_gather(self, scheduler_output, shift_computed_tokens)
        # Called for the drafter (the only caller that shifts). A draft model
        # reads the target's tokens unshifted.
        if knobs.blind_mm:
            return None
        if drafter._twin.get("share_vision"):  # the target's encoder outputs, from its own cache
            return orig_gather(self, scheduler_output, 0)
        self._twin_read_draft_cache = True
        try:
            return orig_gather(self, scheduler_output, 0)
        finally:
            self._twin_read_draft_cache = False

    def _execute_mm_encoder(self, scheduler_output):
        outputs = orig_encoder(self, scheduler_output)
        drafter = _twin_drafter(self)
        if (drafter is None or not drafter.supports_mm_inputs or knobs.blind_mm
                or drafter._twin.get("share_vision")):
            return outputs
        mm_hashes, mm_kwargs, _ = self._batch_mm_inputs_from_scheduler(scheduler_output)
        keep = [i for i, (modality, _) in enumerate(mm_kwargs) if modality != "prompt_embeds"]
        if not keep:
            return outputs
        mm_hashes = [mm_hashes[i] for i in keep]
        mm_kwargs = [mm_kwargs[i] for i in keep]
        cache = self.__dict__.setdefault("_twin_draft_encoder_cache", {})
        draft_model = _draft_model_module(drafter)
        draft_outputs: list[torch.Tensor] = []
        for _modality, _n, batch in gmr.group_and_batch_mm_kwargs(
            mm_kwargs, device=self.device, pin_memory=gmr.PIN_MEMORY
        ):
            draft_outputs.extend(draft_model.embed_multimodal(**batch))
        state.draft_vision_calls += len(draft_outputs)
        for mm_hash, out in zip(mm_hashes, draft_outputs):
            cache[mm_hash] = out
        state.report.update(draft_vision_items_encoded=state.draft_vision_calls)
        return outputs

    def _get_encoder_output_from_cache(self, mm_hash):
        if getattr(self, "_twin_read_draft_cache", False):
            return self.__dict__.get("_twin_draft_encoder_cache", {}).get(mm_hash)
        return orig_from_cache(self, mm_hash)

    def _update_states(self, scheduler_output):
        cache = self.__dict__.get("_twin_draft_encoder_cache")
        if cache:
            for mm_hash in scheduler_output.free_encoder_mm_hashes:
                cache.pop(mm_hash, None)
        return orig_update_states(self, scheduler_output)

    runner_cls._gather_mm_embeddings = _gather_mm_embeddings
    runner_cls._execute_mm_encoder = _execute_mm_encoder
    runner_cls._get_encoder_output_from_cache = _get_encoder_output_from_cache
    runner_cls._update_states = _update_states


def _install_sample_hook(runner_cls, state: EngineState) -> None:
    """``_sample``: the verified rows' request ids on the engine state while the rejection sampler runs."""
    orig_sample = runner_cls._sample

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None:
            return orig_sample(self, logits, spec_decode_metadata)
        state.batch_req_ids = list(self.input_batch.req_ids)
        try:
            return orig_sample(self, logits, spec_decode_metadata)
        finally:
            state.batch_req_ids = None

    runner_cls._sample = _sample


def _install_report_hooks(runner_cls, state: EngineState) -> None:
    """``initialize_kv_cache`` and ``capture_model``: what was built goes into the engine report."""
    orig_capture = runner_cls.capture_model

    def capture_model(self):
        result = orig_capture(self)
        drafter = _twin_drafter(self)
        if drafter is not None:
            dispatcher = getattr(drafter, "cudagraph_dispatcher", None)
            keys = getattr(dispatcher, "cudagraph_keys", None)
            n_keys = sum(len(v) for v in keys.values()) if isinstance(keys, dict) else 0
            state.report.update(
                draft_cudagraph=bool(n_keys),
                draft_cudagraph_capture_done=True,
                draft_cudagraph_keys=n_keys,
                draft_cudagraph_mode=drafter.built_graph_mode(),
                draft_enforce_eager=bool(drafter.speculative_config.enforce_eager),
            )
        return result

    orig_init_kv = runner_cls.initialize_kv_cache

    def initialize_kv_cache(self, *args, **kwargs):
        state.set_parallel(*_tp_place())  # before the first step: only rank 0 writes trace and step rows
        result = orig_init_kv(self, *args, **kwargs)
        try:
            state.report.update(**build_facts(self))
        except Exception as exc:  # a report must never stop an engine
            state.report.update(build_facts_error=repr(exc))
        return result

    runner_cls.initialize_kv_cache = initialize_kv_cache
    runner_cls.capture_model = capture_model


def _install_step_timing(runner_cls, state: EngineState) -> None:
    """With the step timer on: the step's begin and end, and its target and draft spans."""
    orig_execute = runner_cls.execute_model
    orig_forward = runner_cls._model_forward
    orig_propose = runner_cls.propose_draft_token_ids

    def execute_model(self, scheduler_output, *args, **kwargs):
        state.steps.begin(scheduler_output)
        return orig_execute(self, scheduler_output, *args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        with state.steps.span("target"):
            return orig_forward(self, *args, **kwargs)

    def propose_draft_token_ids(self, *args, **kwargs):
        with state.steps.span("draft"):
            return orig_propose(self, *args, **kwargs)

    orig_sample_tokens = runner_cls.sample_tokens

    def sample_tokens(self, *args, **kwargs):
        try:
            return orig_sample_tokens(self, *args, **kwargs)
        finally:
            state.steps.end()  # sampling, verification and drafting are done

    runner_cls.execute_model = execute_model
    runner_cls._model_forward = _model_forward
    runner_cls.propose_draft_token_ids = propose_draft_token_ids
    runner_cls.sample_tokens = sample_tokens


def install(state: EngineState) -> None:
    """Wrap the runner's methods (once per process: ``engine_patches.apply``)."""
    from vllm.v1.worker import gpu_model_runner as gmr

    runner_cls = gmr.GPUModelRunner
    _install_mm_hooks(runner_cls, gmr, state)
    _install_sample_hook(runner_cls, state)
    _install_report_hooks(runner_cls, state)
    if state.steps is not None:
        _install_step_timing(runner_cls, state)
