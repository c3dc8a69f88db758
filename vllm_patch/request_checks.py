"""The relaxed tier accepts greedy requests only: a sampled request is refused where vLLM checks requests.

The relaxed gate is defined for greedy verification; a request with temperature > 0 in an engine
started with ``VLLM_SPEC_RELAX_LOGTAU`` > 0 is refused with a message naming the variable, offline
(``LLM``, a ``ValueError``) and over HTTP (``vllm serve``: 400 with that message).
"""

from __future__ import annotations

from .knobs import EngineKnobs


def install(knobs: EngineKnobs) -> None:
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
