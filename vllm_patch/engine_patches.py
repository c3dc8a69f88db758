"""Run-time changes to vLLM 0.27.1 that make a Qwen3-VL twin a working draft.

Everything here wraps or replaces methods on vLLM's own classes; no vLLM file
is copied or edited. Each wrapper is narrow: it acts only for the
``draft_model`` method and otherwise defers to the original. The drafting loop
itself (the first five points below) is ``twin_proposer.TwinDraftProposer``, a
subclass of vLLM's ``DraftModelProposer`` that the runner constructs in its
place; this module keeps the runner, verification and report changes.

What stock 0.27.1 gets wrong for an M-RoPE draft, and what is done here:

* ``_raise_if_mrope`` refuses the draft outright -> allowed for ``draft_model``.
* ``self.positions`` is never allocated for an M-RoPE draft, but the
  copy/expand kernel of the first draft pass writes 1-D positions into it
  -> allocated as a scratch buffer of sequence positions.
* The first pass is fed the target's M-RoPE positions where 1-D sequence
  positions are expected (the kernel reads row 0, the temporal row). After an
  image the temporal row is compressed, so the KV-cache slot mapping of the
  draft pointed at the wrong slots -> the kernel is fed the runner's sequence
  positions, and the draft's 3-D positions are rebuilt afterwards: every target
  token keeps its exact (t, h, w) triple, every appended token is a text token
  at ``seq + delta`` where ``delta`` is that request's M-RoPE offset.
* Later draft steps advanced M-RoPE row 0 as if it were the sequence position
  -> the sequence position and the M-RoPE offset are carried separately.
* The multimodal mask is gathered with EAGLE's one-token shift and for the
  target's token layout, while the draft's first pass inserts one slot per
  request (the off-by-one reported upstream) -> gathered without shift and
  scattered into the draft's layout.
* The draft runs its own vision tower on the request's images (its encoder
  outputs are cached beside the target's), unless ``blind_mm`` is on: then
  the image placeholder positions keep the draft's embedding of the
  ``<|image_pad|>`` token and their (t, h, w) positions, and no vision tower
  of the draft runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch

from .knobs import EngineKnobs, Knob, KnobError

_PATCHED_MARK = "_twin_spec_patched"
_state_lock = threading.Lock()


# --------------------------------------------------------------------------- #
# Per-process report: what the engine actually runs with                      #
# --------------------------------------------------------------------------- #
class EngineReport:
    """Writes ``engine-<pid>.json`` into the report directory.

    The workbench reads these back to state the knobs in effect as seen inside
    the engine, not as requested.
    """

    def __init__(self, knobs: EngineKnobs):
        self.knobs = knobs
        self.facts: dict[str, Any] = {"pid": os.getpid(), "knobs": knobs.as_dict()}

    def update(self, **facts: Any) -> None:
        with _state_lock:
            self.facts.update(facts)
            if not self.knobs.report_dir:
                return
            os.makedirs(self.knobs.report_dir, exist_ok=True)
            path = os.path.join(self.knobs.report_dir, f"engine-{os.getpid()}.json")
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.facts, f, indent=1, default=str)
            os.replace(tmp, path)


class _JsonlWriter:
    """A daemon thread that turns queued batches into lines of one JSONL file.

    The engine's thread only puts batches on a queue; ``lines(batch)`` runs
    in the writer thread. :meth:`flush_queue` waits until everything queued so
    far is on disk and re-raises a writer failure.
    """

    def __init__(self, path: str, name: str):
        import queue

        self.path = path
        self._name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def lines(self, batch) -> list[str]:
        raise NotImplementedError

    def put(self, batch) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(batch)

    def _run(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            while True:
                item = self._queue.get()
                try:
                    if isinstance(item, threading.Event):
                        f.flush()
                        item.set()
                    else:
                        f.writelines(self.lines(item))
                except BaseException as exc:  # surfaced by flush_queue()
                    self._error = exc
                finally:
                    self._queue.task_done()

    def flush_queue(self, timeout: float = 60.0) -> None:
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            if not done.wait(timeout):
                raise TimeoutError(f"{self.path} not written within {timeout}s")
        if self._error is not None:
            raise RuntimeError(f"writing {self.path} failed: {self._error!r}") from self._error


class TraceWriter(_JsonlWriter):
    """Per verification step and request: drafted, accepted, target margins.

    The verification step only keeps what it traced: two small tensors that
    stay on the device, plus the request ids and draft counts it already has on
    the host. Nothing on the decode path synchronises with the device, copies,
    allocates pinned memory or formats JSON. Every ``batch_steps`` steps (and at
    :meth:`flush`) the kept tensors are concatenated on the device and copied
    off it in one non-blocking copy behind an event; a background thread waits
    for that copy, turns the steps into JSON lines and appends them to
    ``trace-<pid>.jsonl``. :meth:`flush` (called by the leg through
    ``collective_rpc`` once ``generate`` returns) hands over the rest and waits
    until the file holds every step.

    Line format: ``{"s": step, "r": [[req_id, drafted, accepted, margins], ...]}``
    plus ``"invalid": {req_id: n}`` when vLLM passed ``n`` placeholder ids for a
    request; ``drafted`` counts valid drafted tokens only (as vLLM's counters
    do) and ``margins`` has one entry per valid drafted token, rounded to 4
    decimals. ``"ties": {req_id: [i, ...]}`` lists drafted positions written as
    margin 0 that the target's argmax did not pick (tied in the logits' dtype,
    or closer than the rounding): strict verification rejected them, and a
    relaxed gate at any x > 0 accepts them (margin <= x).
    """

    ZERO = 5e-5   # margins below this are written as 0.0
    TIE = -1.0    # device-side mark of a tied, not-picked draft (never a real margin)

    def __init__(self, report_dir: str, batch_steps: int = 512):
        super().__init__(os.path.join(report_dir, f"trace-{os.getpid()}.jsonl"), "twin-spec-trace")
        self.batch_steps = batch_steps
        self.step = 0
        self.host_ns = 0  # host time the trace spent on the decode path (counted by the sampler's wrapper)
        self._pending: list[tuple] = []

    # -- decode path: keep references, nothing else ------------------------ #
    def record(self, req_ids, num_draft_tokens, accepted, margins) -> None:
        self.step += 1
        self._pending.append((self.step, list(req_ids), list(num_draft_tokens), accepted, margins))
        if len(self._pending) >= self.batch_steps:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self._pending:
            return
        steps, self._pending = self._pending, []
        # One concatenation and one copy off the device for the whole batch.
        acc = torch.cat([s[3].reshape(-1).to(torch.int32) for s in steps])
        mar = torch.cat([s[4].reshape(-1).float() for s in steps])
        event = None
        if acc.device.type == "cuda":
            host_acc = torch.empty(acc.shape, dtype=acc.dtype, pin_memory=True)
            host_mar = torch.empty(mar.shape, dtype=mar.dtype, pin_memory=True)
            host_acc.copy_(acc, non_blocking=True)
            host_mar.copy_(mar, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            acc, mar = host_acc, host_mar
        meta = [(st, rids, k, int(a.numel()), int(m.numel())) for st, rids, k, a, m in steps]
        self.put((meta, acc, mar, event))

    # -- writer thread ---------------------------------------------------- #
    def lines(self, batch) -> list[str]:
        meta, acc, mar, event = batch
        if event is not None:
            event.synchronize()
        acc, mar = acc.tolist(), mar.tolist()
        out, ia, im = [], 0, 0
        for step, req_ids, ks, n_acc, n_mar in meta:
            line = self._format(step, req_ids, ks, acc[ia : ia + n_acc], mar[im : im + n_mar])
            ia, im = ia + n_acc, im + n_mar
            if line:
                out.append(line)
        return out

    @staticmethod
    def _format(step, req_ids, num_draft_tokens, acc: list, m: list) -> str:
        rows, invalid, ties, off = [], {}, {}, 0
        for i, (rid, k) in enumerate(zip(req_ids, num_draft_tokens)):
            if k > 0:
                # NaN marks a placeholder / out-of-range id: never an index,
                # never accepted, no margin; vLLM's counters skip it too.
                valid = [v for v in m[off : off + k] if v == v]
                tied = [j for j, v in enumerate(valid) if v < 0]
                rows.append([rid, len(valid), max(int(acc[i]), 0), [0.0 if v < 0 else round(v, 4) for v in valid]])
                if len(valid) < k:
                    invalid[rid] = k - len(valid)
                if tied:
                    ties[rid] = tied
            off += k
        if not rows:
            return ""
        line = {"s": step, "r": rows}
        if invalid:
            line["invalid"] = invalid
        if ties:
            line["ties"] = ties
        return json.dumps(line) + "\n"

    def flush(self, timeout: float = 60.0) -> int:
        """Write every traced step; returns the number of steps traced so far."""
        self._hand_over()
        self.flush_queue(timeout)
        return self.step


class StepTimer(_JsonlWriter):
    """Engine-side time of every model step: the target's forward and the drafting.

    ``VLLM_SPEC_STEP_TIMING=1`` (with ``VLLM_SPEC_REPORT_DIR``): for each
    ``execute_model`` step the target's forward pass and the drafter's
    ``propose`` are bracketed by CUDA events (wall clock on CPU, where the
    work is synchronous). Nothing waits on the device on the decode path; a
    background thread resolves the events and appends one JSON line per step
    to ``steps-<pid>.jsonl``: ``{"reqs", "tokens", "spec_tokens", "prefill",
    "target_ms", "draft_ms", "draft_loop_ms"}`` (``draft_loop_ms``: the propose's gamma-1
    single-token steps, from the first position update to the last sample). Written for the GPU cost ladder: a verification
    step is one with ``tokens == reqs * (1 + gamma)``.
    """

    # a measurement switch, not an experiment knob: parsed like the table's booleans
    SWITCH = Knob("step_timing", bool, False, lambda v: True, "true or false",
                  "engine-side step timings", env="VLLM_SPEC_STEP_TIMING")

    def __init__(self, report_dir: str, batch_steps: int = 128):
        super().__init__(os.path.join(report_dir, f"steps-{os.getpid()}.jsonl"), "twin-spec-steps")
        self.batch_steps = batch_steps
        self.current: dict | None = None
        self._done: list[dict] = []

    @staticmethod
    def _mark():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        import time

        return time.perf_counter()

    def begin(self, scheduler_output) -> None:
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", {}) or {}
        new = getattr(scheduler_output, "scheduled_new_reqs", []) or []
        self.current = {
            "reqs": len(getattr(scheduler_output, "num_scheduled_tokens", {}) or {}),
            "tokens": int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)),
            "spec_tokens": int(sum(len(v) for v in spec.values())),
            "prefill": bool(new),
        }

    def span(self, key: str):
        cur = self.current
        timer = self

        class _Span:
            def __enter__(self_inner):
                if cur is not None:
                    cur[key + "_t0"] = timer._mark()

            def __exit__(self_inner, *exc):
                if cur is not None and key + "_t0" in cur:
                    cur[key + "_t1"] = timer._mark()

        return _Span()

    def stamp(self, name: str) -> None:
        """One time mark of the current step (the twin proposer marks its single-token steps)."""
        if self.current is not None:
            self.current[name] = self._mark()

    def end(self) -> None:
        cur, self.current = self.current, None
        if cur is None or "target_t0" not in cur:
            return
        self._done.append(cur)
        if len(self._done) >= self.batch_steps:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._done:
            self.put(self._done)
            self._done = []

    @staticmethod
    def _ms(t0, t1):
        if t0 is None or t1 is None:
            return None
        if isinstance(t0, float):
            return round((t1 - t0) * 1e3, 4)
        t1.synchronize()
        return round(t0.elapsed_time(t1), 4)

    def lines(self, batch) -> list[str]:
        out = []
        for cur in batch:
            row = {k: cur[k] for k in ("reqs", "tokens", "spec_tokens", "prefill")}
            row["target_ms"] = self._ms(cur.get("target_t0"), cur.get("target_t1"))
            row["draft_ms"] = self._ms(cur.get("draft_t0"), cur.get("draft_t1"))
            # the gamma-1 single-token draft steps of the propose (absent for gamma 1)
            row["draft_loop_ms"] = self._ms(cur.get("draft_loop_t0"), cur.get("draft_loop_t1"))
            out.append(json.dumps(row) + "\n")
        return out

    def flush(self, timeout: float = 60.0) -> None:
        self._hand_over()
        self.flush_queue(timeout)


class _Globals:
    knobs: EngineKnobs | None = None
    report: EngineReport | None = None
    trace: TraceWriter | None = None
    # kept while tracing is switched off at run time (benchmarks: side by side in one engine)
    trace_parked: TraceWriter | None = None
    steps: StepTimer | None = None
    # Set by the runner's _sample around the rejection sampler call so that the
    # sampler wrapper knows which requests its rows belong to.
    batch_req_ids: list[str] | None = None
    draft_vision_calls: int = 0


G = _Globals()


# --------------------------------------------------------------------------- #
# Model runner: multimodal inputs of the draft, trace bookkeeping             #
# --------------------------------------------------------------------------- #
def _draft_model_module(drafter):
    model = drafter.model
    unwrap = getattr(model, "unwrap", None)
    return unwrap() if callable(unwrap) else model


def _linear_kernels(model) -> dict[str, int]:
    """How many linear layers of a model run on which method / kernel."""
    counts: dict[str, int] = {}
    if model is None:
        return counts
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "apply"):
            continue
        name = type(method).__name__
        if "Embedding" in type(module).__name__ or "Embedding" in name or "KVCache" in name:
            continue
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme, "kernel", None)
        if kernel is not None:
            name = f"{type(scheme).__name__}/{type(kernel).__name__}"
        elif scheme is not None:
            name = type(scheme).__name__
        counts[name] = counts.get(name, 0) + 1
    return counts


def _attention_backends(runner, draft_layers: set[str]) -> dict[str, list[str]]:
    """Attention backend of the target's and the draft's decoder layers."""
    out: dict[str, set[str]] = {"target": set(), "draft": set()}
    ctx = getattr(runner.compilation_config, "static_forward_context", {}) or {}
    for name, layer in ctx.items():
        get_backend = getattr(layer, "get_attn_backend", None)
        if get_backend is None:
            continue
        try:
            label = get_backend().get_name()
        except Exception:
            continue
        fa = getattr(getattr(layer, "impl", None), "vllm_flash_attn_version", None)
        if fa:
            label = f"{label}/FA{fa}"
        out["draft" if name in draft_layers else "target"].add(label)
    return {k: sorted(v) for k, v in out.items()}


def _weight_bytes(model) -> int | None:
    if model is None:
        return None
    tensors = list(model.parameters()) + list(model.buffers())
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _build_facts(runner) -> dict[str, Any]:
    from vllm.platforms import current_platform

    from . import cpu_int4

    drafter = getattr(runner, "drafter", None)
    draft_model = getattr(drafter, "model", None) if drafter is not None else None
    draft_layers = set(getattr(drafter, "_draft_attn_layer_names", set()) or set())
    facts: dict[str, Any] = {
        "weight_bytes": {"target": _weight_bytes(getattr(runner, "model", None)), "draft": _weight_bytes(draft_model)},
        "attention_backend": _attention_backends(runner, draft_layers),
        "linear_kernels": {
            "target": _linear_kernels(getattr(runner, "model", None)),
            "draft": _linear_kernels(draft_model),
        },
    }
    if current_platform.is_cpu():
        kernels = facts["linear_kernels"]["target"] | facts["linear_kernels"]["draft"]
        int4_layers = [k for k in kernels if "WNA16" in k]
        facts["cpu_vector_extensions"] = cpu_int4.cpu_vector_extensions()
        facts["cpu_kernel_library"] = cpu_int4.cpu_kernel_library()
        facts["int4_native_op"] = cpu_int4.native_wna16_available()
        facts["int4_path"] = (
            ("fallback" if any(cpu_int4.KERNEL_NAME in k for k in int4_layers) else "native")
            if int4_layers else None
        )
    else:
        facts["int4_path"] = None
        facts["gpu"] = str(current_platform.get_device_name())
    return facts


def _patch_runner(knobs: EngineKnobs) -> None:
    from vllm.v1.worker import gpu_model_runner as gmr

    runner_cls = gmr.GPUModelRunner
    orig_gather = runner_cls._gather_mm_embeddings
    orig_encoder = runner_cls._execute_mm_encoder
    orig_from_cache = runner_cls._get_encoder_output_from_cache
    orig_update_states = runner_cls._update_states
    orig_sample = runner_cls._sample

    def _twin_drafter(self):
        drafter = getattr(self, "drafter", None)
        if drafter is None or getattr(drafter, "_twin", None) is None:
            return None
        return drafter

    def _gather_mm_embeddings(self, scheduler_output, shift_computed_tokens=0):
        drafter = _twin_drafter(self)
        if drafter is None or shift_computed_tokens != 1:
            return orig_gather(self, scheduler_output, shift_computed_tokens)
        # Called for the drafter (the only caller that shifts). A draft model
        # reads the target's tokens unshifted.
        if knobs.blind_mm:
            return None
        self._twin_read_draft_cache = True
        try:
            return orig_gather(self, scheduler_output, 0)
        finally:
            self._twin_read_draft_cache = False

    def _execute_mm_encoder(self, scheduler_output):
        outputs = orig_encoder(self, scheduler_output)
        drafter = _twin_drafter(self)
        if drafter is None or not drafter.supports_mm_inputs or knobs.blind_mm:
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
        G.draft_vision_calls += len(draft_outputs)
        for mm_hash, out in zip(mm_hashes, draft_outputs):
            cache[mm_hash] = out
        G.report.update(draft_vision_items_encoded=G.draft_vision_calls)
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

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None:
            return orig_sample(self, logits, spec_decode_metadata)
        G.batch_req_ids = list(self.input_batch.req_ids)
        try:
            return orig_sample(self, logits, spec_decode_metadata)
        finally:
            G.batch_req_ids = None

    runner_cls._gather_mm_embeddings = _gather_mm_embeddings
    runner_cls._execute_mm_encoder = _execute_mm_encoder
    runner_cls._get_encoder_output_from_cache = _get_encoder_output_from_cache
    runner_cls._update_states = _update_states
    runner_cls._sample = _sample

    orig_capture = runner_cls.capture_model

    def capture_model(self):
        result = orig_capture(self)
        drafter = _twin_drafter(self)
        if drafter is not None:
            dispatcher = getattr(drafter, "cudagraph_dispatcher", None)
            keys = getattr(dispatcher, "cudagraph_keys", None)
            n_keys = sum(len(v) for v in keys.values()) if isinstance(keys, dict) else 0
            G.report.update(
                draft_cudagraph=bool(n_keys),
                draft_cudagraph_capture_done=True,
                draft_cudagraph_keys=n_keys,
                draft_cudagraph_mode=drafter.built_graph_mode(),
                draft_enforce_eager=bool(drafter.speculative_config.enforce_eager),
            )
        return result

    orig_init_kv = runner_cls.initialize_kv_cache

    def initialize_kv_cache(self, *args, **kwargs):
        result = orig_init_kv(self, *args, **kwargs)
        try:
            G.report.update(**_build_facts(self))
        except Exception as exc:  # a report must never stop an engine
            G.report.update(build_facts_error=repr(exc))
        return result

    runner_cls.initialize_kv_cache = initialize_kv_cache

    if G.steps is not None:
        orig_execute = runner_cls.execute_model
        orig_forward = runner_cls._model_forward
        orig_propose = runner_cls.propose_draft_token_ids

        def execute_model(self, scheduler_output, *args, **kwargs):
            G.steps.begin(scheduler_output)
            return orig_execute(self, scheduler_output, *args, **kwargs)

        def _model_forward(self, *args, **kwargs):
            with G.steps.span("target"):
                return orig_forward(self, *args, **kwargs)

        def propose_draft_token_ids(self, *args, **kwargs):
            with G.steps.span("draft"):
                return orig_propose(self, *args, **kwargs)

        orig_sample_tokens = runner_cls.sample_tokens

        def sample_tokens(self, *args, **kwargs):
            try:
                return orig_sample_tokens(self, *args, **kwargs)
            finally:
                G.steps.end()  # sampling, verification and drafting are done

        runner_cls.execute_model = execute_model
        runner_cls._model_forward = _model_forward
        runner_cls.propose_draft_token_ids = propose_draft_token_ids
        runner_cls.sample_tokens = sample_tokens
    runner_cls.capture_model = capture_model


# --------------------------------------------------------------------------- #
# Verification: relaxed gate and acceptance trace                             #
# --------------------------------------------------------------------------- #
def _patch_rejection_sampler(knobs: EngineKnobs) -> None:
    from vllm.v1.sample import rejection_sampler as rs

    orig_rejection_sample = rs.rejection_sample
    x = float(knobs.relax_logtau)

    def rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        target_logits,
        bonus_token_ids,
        sampling_metadata,
        *args,
        **kwargs,
    ):
        req_ids = G.batch_req_ids
        trace = G.trace if req_ids is not None else None
        t0 = time.perf_counter_ns() if trace is not None else 0
        margins = None
        if (x > 0 or trace is not None) and draft_token_ids.numel() > 0:
            vocab = target_logits.shape[-1]
            # vLLM pads drafts it invalidated with -1 (its kernels reject them):
            # such an id is never an index, never passes, and has no margin.
            idx = draft_token_ids.long().clamp(0, vocab - 1)
            invalid = idx != draft_token_ids
            idx = idx.unsqueeze(1)
            drafted_logit = target_logits.gather(1, idx).squeeze(1)
            # vLLM's greedy verification accepts a draft iff it is torch's argmax
            # (the first index among tied maxima); the same argmax decides "picked".
            pick = target_logits.argmax(dim=-1)
            top = target_logits.gather(1, pick.unsqueeze(1)).squeeze(1)
            margins = (top - drafted_logit).float().masked_fill_(invalid, float("nan"))
            if x > 0:
                passes = margins <= x  # an invalid id's margin is NaN: it never passes
                if not sampling_metadata.all_greedy:
                    greedy_req = sampling_metadata.temperature == rs.GREEDY_TEMPERATURE
                    counts = torch.as_tensor(num_draft_tokens, device=greedy_req.device)
                    passes &= torch.repeat_interleave(
                        greedy_req, counts, output_size=draft_token_ids.shape[0]
                    )
                # Make a passing drafted token the argmax of its row; the
                # greedy kernel then accepts up to the first failing position
                # and emits the (true) argmax there and as the bonus token.
                # Rows of invalid ids write their (clamped) column's own logit back.
                raised = torch.where(passes, top + 1.0, drafted_logit)
                target_logits.scatter_(1, idx, raised.unsqueeze(1))
        # host time the trace adds to the step: the margins (unless the relaxed gate needs them) ...
        traced_ns = time.perf_counter_ns() - t0 if trace is not None and x <= 0 else 0
        out = orig_rejection_sample(
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            *args,
            **kwargs,
        )
        if trace is not None:
            t1 = time.perf_counter_ns()
            accepted = (out != rs.PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1
            if margins is None:
                margins = torch.empty(0, device=out.device)
            else:
                # The tie rule: a token the target did not pick but whose margin the
                # trace would write as 0 (a bf16 tie, or below its 4 decimals) is
                # marked, so strict (x = 0) replays as rejected and x > 0 as accepted.
                margins = margins.masked_fill(
                    (pick != idx.squeeze(1)) & (margins < TraceWriter.ZERO), TraceWriter.TIE)
            trace.record(req_ids, num_draft_tokens, accepted, margins)
            # ... and the count of accepted tokens and the recording (a batch hand-over included)
            trace.host_ns += traced_ns + time.perf_counter_ns() - t1
        return out

    rs.rejection_sample = rejection_sample


def _patch_input_processor(knobs: EngineKnobs) -> None:
    """Refuse sampled requests in the relaxed tier, before anything is sent back.

    The check runs where vLLM validates a request's parameters (offline
    ``LLM`` and the server alike) and, for the server, once more when
    ``AsyncLLM.generate`` is called: vLLM validates only when the returned
    generator is first iterated, and a streamed response has sent HTTP 200 by
    then, so the refusal would arrive as an error event inside the stream.
    Raised at the call, it reaches the client as HTTP 400 with its message.
    """
    if knobs.relax_logtau <= 0:
        return
    import functools

    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import async_llm
    from vllm.v1.engine import input_processor as ip

    # A VLLMValidationError is what a server answers as HTTP 400 with its
    # message (a plain ValueError became an empty 500 inside AsyncLLM.generate);
    # it is still a ValueError for offline callers.
    class RelaxedTierRefusal(VLLMValidationError, ValueError):
        pass

    def refuse_sampled(speculative_config, params) -> None:
        if speculative_config is not None and isinstance(params, SamplingParams) and params.temperature > 0:
            raise RelaxedTierRefusal(
                f"The relaxed tier (VLLM_SPEC_RELAX_LOGTAU={knobs.relax_logtau}) is "
                "defined for greedy requests only; this request has "
                f"temperature={params.temperature}. Use temperature=0 or unset "
                "VLLM_SPEC_RELAX_LOGTAU.",
                parameter="temperature",
                value=params.temperature,
            )

    orig_validate = ip.InputProcessor._validate_params

    def _validate_params(self, params, supported_tasks):
        orig_validate(self, params, supported_tasks)
        refuse_sampled(self.speculative_config, params)

    ip.InputProcessor._validate_params = _validate_params

    orig_generate = async_llm.AsyncLLM.generate

    @functools.wraps(orig_generate)
    def generate(self, *args, **kwargs):
        # a plain function returning vLLM's async generator: callers iterate it as before
        params = kwargs["sampling_params"] if "sampling_params" in kwargs else (args[1] if len(args) > 1 else None)
        refuse_sampled(self.vllm_config.speculative_config, params)
        return orig_generate(self, *args, **kwargs)

    async_llm.AsyncLLM.generate = generate


def _patch_compressed_tensors_ignore() -> None:
    """Let a draft's quantization ignore list reach its own layers.

    The draft is built under the module prefix ``draft_model.``, so its layer
    names never equal the checkpoint's ignore entries: the unquantized vision
    tower of an AWQ twin was then built as int4 layers, and loading failed
    looking for ``weight_packed`` there. Match with the prefix removed too.
    """
    from vllm.model_executor.layers.quantization.compressed_tensors import (
        compressed_tensors as ct,
    )

    orig = ct.should_ignore_layer
    prefix = "draft_model."

    def should_ignore_layer(layer_name, ignore=tuple(), fused_mapping=None):
        kw = {} if fused_mapping is None else {"fused_mapping": fused_mapping}
        if orig(layer_name, ignore, **kw):
            return True
        if layer_name and layer_name.startswith(prefix):
            return orig(layer_name[len(prefix):], ignore, **kw)
        return False

    ct.should_ignore_layer = should_ignore_layer


def flush_trace() -> int:
    """Write out every traced step of this process; the number of steps traced."""
    return G.trace.flush() if G.trace is not None else 0


def _patch_worker_rpc() -> None:
    """``llm.collective_rpc("twin_spec_flush_trace")`` reaches every worker."""
    from vllm.v1.worker.worker_base import WorkerBase

    def twin_spec_flush_trace(self) -> int:
        return flush_trace()

    def twin_spec_set_trace(self, on: bool) -> bool:
        """Switch tracing off/on in a running engine (trace-cost benchmark, one engine)."""
        if on and G.trace is None and G.trace_parked is not None:
            G.trace, G.trace_parked = G.trace_parked, None
        elif not on and G.trace is not None:
            G.trace.flush()
            G.trace, G.trace_parked = None, G.trace
        return G.trace is not None

    def twin_spec_trace_stats(self) -> dict:
        """Steps traced and the host time the trace spent on the decode path, this process."""
        t = G.trace or G.trace_parked
        return {"steps": t.step, "host_ms": t.host_ns / 1e6} if t is not None else {"steps": 0, "host_ms": 0.0}

    def twin_spec_flush_steps(self) -> str | None:
        if G.steps is None:
            return None
        G.steps.flush()
        return G.steps.path

    def _drafter(self):
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        return drafter if getattr(drafter, "_twin", None) is not None else None

    def twin_spec_set_draft_graphs(self, on: bool) -> bool:
        """The twin drafter's dispatch forced to eager although its graphs exist (cost ladder: on/off in one engine)."""
        drafter = _drafter(self)
        if drafter is not None:
            drafter._twin_graphs_off = not on
        return on

    def twin_spec_draft_graph_stats(self) -> dict | None:
        """Single-token draft steps by the graph mode they ran under, and the mode built."""
        drafter = _drafter(self)
        if drafter is None:
            return None
        return {"built": drafter.built_graph_mode(), "dispatched": dict(drafter._twin_dispatched)}

    WorkerBase.twin_spec_flush_trace = twin_spec_flush_trace
    WorkerBase.twin_spec_set_draft_graphs = twin_spec_set_draft_graphs
    WorkerBase.twin_spec_draft_graph_stats = twin_spec_draft_graph_stats
    WorkerBase.twin_spec_set_trace = twin_spec_set_trace
    WorkerBase.twin_spec_flush_steps = twin_spec_flush_steps
    WorkerBase.twin_spec_trace_stats = twin_spec_trace_stats


def apply(knobs: EngineKnobs) -> None:
    """Install every change once per process (plugins load more than once)."""
    import vllm

    if getattr(vllm, _PATCHED_MARK, False):
        return
    G.knobs = knobs
    G.report = EngineReport(knobs)
    G.report.update()
    if knobs.trace and knobs.report_dir:
        G.trace = TraceWriter(knobs.report_dir)
    if StepTimer.SWITCH.read_env(os.environ):
        if not knobs.report_dir:
            raise KnobError(f"{StepTimer.SWITCH.env}=1 needs VLLM_SPEC_REPORT_DIR: the folder step timings go to")
        G.steps = StepTimer(knobs.report_dir)
    from . import twin_proposer

    twin_proposer.install()  # the twin's drafting loop: vllm_patch/twin_proposer.py
    _patch_runner(knobs)
    _patch_rejection_sampler(knobs)
    _patch_input_processor(knobs)
    _patch_compressed_tensors_ignore()
    _patch_worker_rpc()
    from . import cpu_int4

    cpu_int4.install()
    setattr(vllm, _PATCHED_MARK, True)
