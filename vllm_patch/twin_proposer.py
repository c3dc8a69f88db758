"""The twin's drafting loop: vLLM 0.27.1's draft_model proposer with M-RoPE, its own images and CUDA graphs.

``TwinDraftProposer`` subclasses vLLM's ``DraftModelProposer`` and overrides its hooks; the plugin
installs it where vLLM's GPU model runner constructs its drafter (the ``DraftModelProposer`` name in
``vllm.v1.worker.gpu_model_runner``), so no vLLM class is changed and every other proposer is
vLLM's own. What each hook changes, and why, is in the docstring of ``engine_patches``; state of one
proposer lives on it (``self._twin``), and the engine's state it shares with the other patches (knobs,
report, step timer) is the installed ``EngineState``, kept as ``self._twin_engine``: no module global.

The γ−1 single-token draft steps advance positions, slot mapping and M-RoPE positions with tensor
operations on the device only (no ``.item()``, no host copy, no Python loop over requests), so the same code
runs inside a captured CUDA graph. ``draft_cudagraph_mode`` picks how the drafter's forward passes run on
CUDA: ``piecewise`` (vLLM's own drafter graphs), ``full`` (one FULL graph per single-token decode step; the
first pass stays piecewise), ``full_all`` (a uniform decode step's first pass too: ``draft_graphs``), or
``none``; ``auto`` is the best verified mode (``none`` on CPU). On ``own-cuda`` the MLP fuses SiluAndMul.
"""

from __future__ import annotations

import torch
from vllm.config import CUDAGraphMode
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from . import draft_graphs, draft_idle, draft_kernels, draft_load, engine_state


class TwinDraftProposer(DraftModelProposer):
    """vLLM's draft_model proposer for an M-RoPE twin (see the module docstring)."""

    def __init__(self, vllm_config, device, runner=None):
        # set before the base __init__: it calls the _warn/_raise hooks below
        self._twin = None
        self._twin_engine = engine_state.current()
        if self._twin_engine is None:
            raise RuntimeError("TwinDraftProposer needs the twin-spec plugin installed "
                               "(vllm_patch.engine_patches.apply)")
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        knobs = self._twin_engine.knobs
        self._twin_graphs_off = False      # run-time switch: dispatch forced to eager (cost ladder)
        self._twin_full_off = self._twin_first_off = False  # run-time switches: FULL built, run piecewise
        self._twin_calls = 0               # dispatches in this propose: the first is the first pass
        self._twin_full = None             # FULL decode graph state (see initialize_cudagraph_keys)
        self._twin_first, self._twin_first_pad = None, None  # full_all: buffers; this pass's padded batch
        self._twin_first_ran = {"full": 0, "piecewise": 0, "none": 0}  # first passes by mode
        self._twin_dispatched = {m: 0 for m in draft_graphs.GRAPH_MODES}  # single-token steps by graph mode
        self._twin_loop_t0 = False
        self._twin_in_propose = False      # dispatches are counted for real proposes only
        self._twin_full_now = 0    # the padded batch this propose's single-token steps replay (0: none)
        if not self._is_twin():
            return
        from vllm.platforms import current_platform

        on_gpu = current_platform.is_cuda_alike()
        mode, why = draft_graphs.resolve_graph_mode(knobs.draft_cudagraph_mode, knobs.draft_cudagraph, on_gpu)
        self._twin_graph_mode, self._twin_graph_reason = mode, why
        spec = self.speculative_config
        if not knobs.draft_cudagraph or (on_gpu and mode == "none"):
            spec.enforce_eager = True      # the upstream switch for a drafter without CUDA graphs
        target_mrope = bool(vllm_config.model_config.uses_mrope)
        if self.uses_mrope and not target_mrope:
            raise NotImplementedError(
                "An M-RoPE draft needs an M-RoPE target: the draft's 3-D positions "
                "are taken from the target's (got a draft using M-RoPE and a target "
                "that does not)."
            )
        # Whether the draft itself takes images, not whether the target does:
        # a text-only draft of a VLM target must see token embeddings only.
        draft_mm = bool(self.mm_registry.supports_multimodal_inputs(self.draft_model_config))
        self.supports_mm_inputs = draft_mm
        if self.uses_mrope and not hasattr(self, "positions"):
            self.positions = torch.zeros(self.max_positions, dtype=torch.int64, device=device)
        self._twin = {"runner": runner, "target_mrope": target_mrope, "out_idx": None,
                      "seq_pos": None, "delta": None}
        self._twin_kernel = draft_kernels.resolve(knobs.draft_linear_kernel, on_gpu)
        sched = vllm_config.scheduler_config
        self._twin_engine.report.update(
            drafter="draft_model",
            proposer=type(self).__name__,
            draft_model=str(self.draft_model_config.model),
            target_model=str(vllm_config.model_config.model),
            draft_uses_mrope=bool(self.uses_mrope),
            target_uses_mrope=target_mrope,
            draft_takes_images=draft_mm,
            draft_vision=("blind" if knobs.blind_mm else "own") if draft_mm else "text-only draft",
            num_speculative_tokens=int(self.num_speculative_tokens),
            platform=str(current_platform.device_name),
            # What was built, not what was asked: graphs exist only once the
            # capture phase has captured drafter keys (see capture_model).
            draft_cudagraph=False,
            draft_cudagraph_requested=bool(knobs.draft_cudagraph),
            draft_cudagraph_applies=bool(on_gpu),
            draft_cudagraph_keys=0,
            draft_cudagraph_mode="none",
            draft_cudagraph_mode_requested=knobs.draft_cudagraph_mode,
            draft_cudagraph_mode_applies=bool(on_gpu),
            draft_cudagraph_mode_planned=mode,
            draft_cudagraph_mode_reason=why,
            draft_linear_kernel_requested=knobs.draft_linear_kernel,
            draft_linear_kernel_applies=bool(on_gpu),
            draft_linear_kernel_preferred=self._twin_kernel[0],
            draft_linear_kernel_reason=self._twin_kernel[1],
            # vLLM's scheduler config after its own checks: what runs, not what was asked
            async_scheduling=bool(sched.async_scheduling),
            async_scheduling_requested=bool(knobs.async_scheduling),
            async_scheduling_applies=bool(on_gpu),
            relaxed_gate=knobs.relax_logtau,
        )

    def _is_twin(self) -> bool:
        return (self.method == "draft_model" and not self.parallel_drafting
                and bool(self.needs_extra_input_slots))

    # -- construction hooks ----------------------------------------------------------------------- #
    def _warn_if_multimodal(self):
        # Upstream warns that images are ignored; for the twin they are not.
        if not self._is_twin():
            super()._warn_if_multimodal()

    def _raise_if_mrope(self):
        if not self._is_twin():
            super()._raise_if_mrope()

    def _create_draft_vllm_config(self):
        # vLLM keys its compile cache (torch_compile_cache/<hash>) on the config's hash, which knows
        # nothing of the knobs: a drafter compiled with one W4A16 kernel would be loaded from the cache
        # by an engine whose draft layers hold another kernel's parameters (seen on the H200: Marlin
        # after Humming, KeyError 'weight'). The draft's own config carries the kernel in its hash.
        cfg = super()._create_draft_vllm_config()
        if self._twin is None:
            return cfg
        return draft_kernels.tag_config(cfg, self._twin_engine.knobs.draft_linear_kernel, self._twin_kernel[0])

    def load_model(self, target_model) -> None:
        # The target is loaded before its drafter: the kernel order changed here reaches the
        # draft's W4A16 layers only, and is restored before anything else is built.
        if self._twin is None:
            return super().load_model(target_model)
        with draft_kernels.prefer(self._twin_kernel[0]) as refused:
            super().load_model(target_model)
        draft_load.finish(self, target_model, refused)
        if self._twin_graph_mode in ("full", "full_all"):
            # The outer FULL wrapper replays whole passes (single-token steps; first passes too under
            # full_all); under a PIECEWISE dispatch it passes through to the piecewise-compiled model.
            self.model = draft_graphs.make_graph_wrapper(self.model, self.vllm_config)

    # -- CUDA graphs -------------------------------------------------------------------------------- #
    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        if self._twin is None or self._twin_graph_mode not in ("full", "full_all"):
            return super().initialize_cudagraph_keys(cudagraph_mode)
        ok, why = draft_graphs.full_decode_support(self)
        if self.speculative_config.enforce_eager or cudagraph_mode.mixed_mode() == CUDAGraphMode.NONE:
            ok, why = False, "the engine captures no CUDA graphs"
        if self.vllm_config.parallel_config.data_parallel_size > 1:
            ok, why = False, "FULL drafter graphs are not written for data parallelism"
        if not ok:
            self._twin_graph_mode = "piecewise"
            self._twin_engine.report.update(draft_cudagraph_mode_planned="piecewise",
                                            draft_cudagraph_mode_reason=f"full refused: {why}; piecewise instead")
            return super().initialize_cudagraph_keys(cudagraph_mode)
        # vLLM's dispatcher keeps the drafter's piecewise keys (the first pass). The FULL graphs of the
        # single-token steps are the drafter's own: the dispatcher's FULL sizes are the target's
        # (multiples of 1 + gamma, none of them at batch 1 when max_num_seqs is 1), so they are keyed
        # here by padded batch size instead.
        super().initialize_cudagraph_keys(cudagraph_mode)
        cap = self.vllm_config.compilation_config.max_cudagraph_capture_size or self.max_batch_size
        n = self.max_batch_size
        self._twin_full = draft_graphs.full_state(self, n, cap)
        if self._twin_graph_mode == "full_all":
            self._twin_first = draft_graphs.first_pass_state(self, n)

    def _first_pass_tokens(self) -> int:
        """Tokens a request has in a uniform first pass: the gamma + 1 it verified, and its new slot."""
        return int(self.num_speculative_tokens) + 1 + int(self.net_num_new_slots_per_request)

    def _determine_batch_execution_and_padding(self, num_tokens, use_cudagraphs=True):
        if self._twin_graphs_off:
            use_cudagraphs = False
        single = self._twin_calls > 0   # the first dispatch of a propose / dummy run is the first pass
        self._twin_calls += 1
        if not single and self._twin_in_propose and self._twin is not None:
            pad = self._twin_first_pad
            if pad is not None and use_cudagraphs:
                q = self._twin_first["q"]  # the wrapper's key for this pass, then the padded dispatch
                self.model.twin_key, out = draft_graphs.first_pass_key(pad, q), (CUDAGraphMode.FULL, pad * q, None)
                draft_graphs.note_padded(self, num_tokens // q, pad, "first")
            else:
                out = super()._determine_batch_execution_and_padding(num_tokens, use_cudagraphs)
            modes = {CUDAGraphMode.FULL: "full", CUDAGraphMode.PIECEWISE: "piecewise"}
            self._report_first_pass(modes.get(out[0], "none"))
            return out
        # FULL only inside a real propose: a dummy run's inputs are not the persistent buffers'
        # live contents, and a replay would write KV entries at stale slots
        if (single and use_cudagraphs and self._twin_full is not None and self._twin_in_propose
                and not self._twin_full_off):
            padded = draft_graphs.replay_size(num_tokens, self._full_captured(), self._twin_full["padded"])
            if padded is not None:
                self._twin_full_now = padded  # this propose's single-token steps replay the graph of this size
                draft_graphs.note_padded(self, num_tokens, padded, "single")
                self._count_dispatch("full")
                return CUDAGraphMode.FULL, padded, None
        out = super()._determine_batch_execution_and_padding(num_tokens, use_cudagraphs)
        if single:
            self._count_dispatch("piecewise" if out[0] == CUDAGraphMode.PIECEWISE else "none")
        return out

    def _report_first_pass(self, mode: str) -> None:
        """First passes by graph mode; the report's ``draft_first_pass_modes_ran`` learns each once."""
        ran = self._twin_first_ran
        ran[mode] += 1
        if ran[mode] == 1:
            self._twin_engine.report.update(draft_first_pass_modes_ran=[m for m, k in ran.items() if k])

    def _count_dispatch(self, mode: str) -> None:
        """Single-token steps by the graph mode they ran under; the report learns each mode once."""
        if not self._twin_in_propose or self._twin is None:
            return
        self._twin_dispatched[mode] += 1
        if self._twin_dispatched[mode] == 1:  # one report write per mode, not per step
            ran = [m for m in draft_graphs.GRAPH_MODES if self._twin_dispatched[m]]
            self._twin_engine.report.update(draft_single_step_modes_ran=ran)

    def dummy_run(self, num_tokens, use_cudagraphs=True, is_graph_capturing=False, slot_mappings=None):
        self._twin_calls = 0
        super().dummy_run(num_tokens, use_cudagraphs=use_cudagraphs, is_graph_capturing=is_graph_capturing,
                          slot_mappings=slot_mappings)
        full = self._twin_full
        if is_graph_capturing and use_cudagraphs and full is not None and not self._full_captured():
            # the first capture-time dummy run captures every single-token size, largest first (the
            # order vLLM captures in, so the smaller graphs reuse the pool's memory)
            for size in sorted(full["sizes"], reverse=True):
                self._capture_full_decode(size)
            if self._twin_first is not None:  # the first passes', at the same padded sizes
                for size in sorted(full["sizes"], reverse=True):
                    self._capture_full_decode(size, self._twin_first["q"])

    def _capture_full_decode(self, n: int, q: int = 1) -> None:
        draft_graphs.capture_full_decode(self, n, q)

    def _full_captured(self) -> set[int]:
        return draft_graphs.full_captured(self.model)

    def _first_captured(self) -> set[int]:
        return draft_graphs.full_captured(self.model, first_pass=True)

    # -- drafting ----------------------------------------------------------------------------------- #
    def propose(self, *args, **kwargs):
        idle = draft_idle.empty_draft(self, kwargs)
        if idle is not None:
            return idle
        self._twin_calls = 0
        self._twin_loop_t0 = False
        self._twin_full_now, self._twin_first_pad = 0, None  # this propose's FULL replays (steps, first pass)
        self._twin_in_propose = True
        try:
            out = super().propose(*args, **kwargs)
        finally:
            self._twin_in_propose = False
        if self._twin_loop_t0 and self._twin_engine.steps is not None:
            self._twin_engine.steps.stamp("draft_loop_t1")  # end of the gamma-1 single-token steps
        return out

    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                              token_indices_to_sample, cad, num_rejected_tokens_gpu):
        args = (target_token_ids, next_token_ids, target_positions, target_hidden_states,
                token_indices_to_sample, cad, num_rejected_tokens_gpu)
        num_out, sample_idx, new_cad = self._first_pass_inputs(*args)
        return num_out, sample_idx, self._first_pass_metadata(cad, new_cad, num_out)

    def _first_pass_metadata(self, cad, new_cad, num_out: int):
        return draft_graphs.first_pass_metadata(self, cad, new_cad, num_out)

    def _first_pass_inputs(self, target_token_ids, next_token_ids, target_positions, target_hidden_states,
                           token_indices_to_sample, cad, num_rejected_tokens_gpu):
        tw = self._twin
        args = (target_token_ids, next_token_ids, target_positions, target_hidden_states,
                token_indices_to_sample, cad, num_rejected_tokens_gpu)
        if tw is None or not tw["target_mrope"]:
            return super().set_inputs_first_pass(*args)
        num_in = target_token_ids.shape[0]
        # The copy/expand kernel derives every draft slot's position, and so its
        # KV-cache slot, from the first position of each request: that must be
        # the sequence position, not the compressed M-RoPE temporal one.
        seq_positions = tw["runner"].positions[:num_in]
        mrope_in = target_positions
        num_out, sample_idx, new_cad = super().set_inputs_first_pass(*args[:2], seq_positions, *args[3:])
        # Input token i of request r lands at output slot i + r, or i + r + 1
        # when it is a rejected draft (those are moved behind the new slot).
        qsl = cad.query_start_loc
        batch = qsl.shape[0] - 1
        counts = qsl[1:] - qsl[:-1]
        req_of_tok = torch.repeat_interleave(torch.arange(batch, device=qsl.device), counts, output_size=num_in)
        last_valid = qsl[1:] - 1
        if num_rejected_tokens_gpu is not None:
            last_valid = last_valid - num_rejected_tokens_gpu
        tok = torch.arange(num_in, device=qsl.device)
        rejected = tok > last_valid[req_of_tok]
        out_idx = tok + req_of_tok + rejected.to(tok.dtype)
        tw["out_idx"] = out_idx
        if self.uses_mrope:
            last_valid_l = last_valid.long()
            delta = mrope_in[0, last_valid_l] - seq_positions[last_valid_l]
            new_seq = self.positions[sample_idx.long()]
            self.mrope_positions[:, out_idx] = mrope_in
            self.mrope_positions[:, sample_idx.long()] = (new_seq + delta).unsqueeze(0)
            tw["seq_pos"] = new_seq.clone()
            tw["delta"] = delta
        return num_out, sample_idx, new_cad

    def build_model_inputs_first_pass(self, num_tokens, num_input_tokens, mm_embed_inputs):
        tw = self._twin
        if tw is not None and self.supports_mm_inputs:
            if self._twin_engine.knobs.blind_mm or mm_embed_inputs is None:
                mm_embed_inputs = None
            else:
                mm_embeds, is_mm = mm_embed_inputs
                out_idx = tw["out_idx"]
                if out_idx is not None and is_mm is not None and is_mm.shape[0] != num_tokens:
                    remapped = torch.zeros(num_tokens, dtype=torch.bool, device=self.device)
                    remapped[out_idx] = is_mm.to(self.device, non_blocking=True)
                    mm_embed_inputs = (mm_embeds, remapped)
        return super().build_model_inputs_first_pass(num_tokens, num_input_tokens, mm_embed_inputs)

    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, draft_index=0):
        # a pass that replays a FULL graph: its metadata built afresh (draft_graphs.full_pass_metadata)
        pad = self._twin_first_pad if draft_index == 0 else self._twin_full_now
        if self._twin is None or not pad:
            return super().build_per_group_and_layer_attn_metadata(common_attn_metadata, draft_index)
        return draft_graphs.full_pass_metadata(self, common_attn_metadata, pad, first_pass=draft_index == 0)

    def _update_positions_dependent_metadata(self, positions, common_attn_metadata, batch_size,
                                             input_batch_size, block_size):
        """One single-token step's positions, slot mapping and sequence lengths: device ops only."""
        tw = self._twin
        if tw is not None and not self._twin_loop_t0:
            self._twin_loop_t0 = True
            if self._twin_engine.steps is not None:
                self._twin_engine.steps.stamp("draft_loop_t0")
            full = self._twin_full
            if full is not None and self._twin_full_now:
                # A FULL graph reads the sequence lengths it was captured with: move them into
                # that persistent buffer once per propose (the step kernel then advances them there).
                buf = full["seq_lens"]
                buf[:batch_size].copy_(common_attn_metadata.seq_lens[:batch_size])
                buf[batch_size:input_batch_size].zero_()
                common_attn_metadata.seq_lens = buf[:batch_size]
        if tw is None or not self.uses_mrope or tw["seq_pos"] is None:
            return super()._update_positions_dependent_metadata(
                positions, common_attn_metadata, batch_size, input_batch_size, block_size)
        # Advance the sequence position (slot mapping, clamping) through the
        # upstream code, then add each request's M-RoPE offset back.
        seq = tw["seq_pos"][:batch_size].unsqueeze(0)
        super()._update_positions_dependent_metadata(seq, common_attn_metadata, batch_size, input_batch_size,
                                                     block_size)
        tw["seq_pos"] = self.mrope_positions[0, :batch_size].clone()
        self.mrope_positions[:, :batch_size] += tw["delta"][:batch_size].unsqueeze(0)
        return self.mrope_positions[:, :batch_size]

    # -- run-time dispatch switch (cost ladder) ---------------------------------------------------------- #
    def set_dispatch(self, mode) -> str:
        """Dispatch the drafter's passes as ``mode`` from now on: ``True`` / ``"built"`` (the graphs that
        were built), ``"piecewise"`` (with FULL graphs built: the single-token steps piecewise),
        ``False`` / ``"none"`` (eager). A mode that needs graphs that were not built is an error."""
        built = self.built_graph_mode()
        if mode is True or mode == "built":
            mode = built
        elif mode is False:
            mode = "none"
        if mode not in draft_graphs.GRAPH_MODES:
            raise ValueError(f"draft dispatch mode {mode!r}: expected one of {draft_graphs.GRAPH_MODES}, "
                             "True or 'built'")
        order = draft_graphs.GRAPH_MODES  # none < piecewise < full < full_all: each includes the previous
        if order.index(mode) > order.index(built):
            raise ValueError(f"draft dispatch mode {mode!r}: this engine built {built!r} drafter graphs")
        self._twin_graphs_off = mode == "none"
        self._twin_full_off = mode not in ("full", "full_all")
        self._twin_first_off = mode != "full_all"
        return mode

    # -- what was built ------------------------------------------------------------------------------ #
    def built_graph_mode(self) -> str:
        if self._twin_full is not None and self._full_captured():
            return "full_all" if self._twin_first is not None and self._first_captured() else "full"
        keys = getattr(self.cudagraph_dispatcher, "cudagraph_keys", None) or {}
        return "piecewise" if keys.get(CUDAGraphMode.PIECEWISE) else "none"


def install() -> None:
    """Construct the twin proposer where vLLM's GPU model runner builds its draft_model drafter."""
    from vllm.v1.worker import gpu_model_runner as gmr

    # The runner names the class at module level (``DraftModelProposer(vllm_config=..., ...)``);
    # isinstance checks elsewhere still hold for the subclass.
    gmr.DraftModelProposer = TwinDraftProposer
