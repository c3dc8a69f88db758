"""One leg: one process, one engine, one configuration, every prompt decoded greedily.

    python -m workbench.leg --config legs/<leg>/leg.json          (what the protocol runs)

The package, in the order a leg goes through it: ``config`` (``LegConfig``,
``LegError``), ``checks`` (every input that can be checked before an engine
starts, without torch or vLLM), ``setup`` (the engine's arguments and the
process environment), ``run`` (``run_leg``: the generate loop, records and
summary), ``reports`` (what the engine reports: counters, step costs, the
acceptance trace) and ``command`` (the command line, failure records, dying
with the run). Every name is importable from ``workbench.leg``.
"""

from ..engine import in_process_cpu_env  # noqa: F401  (re-exported: the thread settings of a CPU leg)
from .checks import (_PROCESSOR_LOCK, _processor, _vocab_size, check_inputs, gamma_problem, installed_vllm_version,
                     is_local, length_problems, model_problems, preflight, prompt_lengths, read_model_config,
                     spec_len_limit, tensor_parallel_problems)
from .command import (_out_of, _stop_own_group, build_parser, config_from_args, die_with_parent,
                      is_environment_error, main, report_failure, write_failure)
from ..metrics import acceptance_length, acceptance_rate  # noqa: F401  (re-exported: serve_leg reads them here)
from .config import PARENT_ENV, WORKLOAD_KNOBS, LegConfig, LegError, load_leg_config
from .reports import (_SPEC_METRICS, PER_RANK_FACTS, RankDisagreement, TraceTail, _counter_delta, _external_id,
                      _knobs_in_effect, _quartiles, committed_steps, leg_step_costs, merge_rank_reports,
                      per_prompt_spec, read_engine_reports, read_trace, spec_counters, step_costs_of)
from .run import _resumable_records, run_leg
from .setup import _cuda_present, _in_process, engine_args, prepare_process_env
