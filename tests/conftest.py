"""The suite's two tiers, in one place.

`make test` runs the default tier (`pytest -m "not slow"`): every area (engine exactness on one text and one
vision-language architecture, cache, link, scheduler and predictors, results store and comparisons, scoring,
the task YAMLs, the sandbox, the CLIs' bad input in-process), in a few minutes on 2 cores. `make test-all`,
which CI runs, runs every test. A test is `slow` (full tier only) when it is listed here: a whole module, or
single tests by function name (every parametrization), or an architecture sweep beyond the default
architectures. What costs the time is nearly always a fresh interpreter (a CLI subprocess imports torch,
transformers and lm-eval: 10-40 s each), an lm-eval evaluation end to end, or a property-based search;
the seconds quoted are from one run of the whole suite on the 2-core development machine under other load.
"""
from pathlib import Path

import pytest

# Whole modules in the full tier only, and why.
SLOW_MODULES = {
    "test_lm_adapter": "lm-eval evaluations through the adapter and evalsuite-lm-eval subprocesses (250 s)",
    "test_hub_models": "evalsuite eval / lm-eval subprocesses on a model from a Hub cache (160 s)",
    "test_benchmark_tasks": "every benchmark YAML on its full data file, an lm_eval CLI subprocess (120 s)",
    "test_eval_resume": "kills an evalsuite eval subprocess and resumes it (85 s)",
    "test_lm_offloaded_loading": "the lm-eval adapters loading offloaded models, lm-eval runs (70 s)",
    "test_cold_cache": "two tasks in one lm-eval run against each alone (60 s)",
    "test_lm_sample_metrics": "lm-eval runs and an evalsuite-lm-eval subprocess with --db (55 s)",
    "test_wheel_install": "builds a wheel, installs it and runs evalsuite eval from it (50 s)",
    "test_import_side_effects": "fresh interpreters importing evalsuite and lm-eval (40 s)",
    "test_eval_same_tokens": "three evalsuite eval runs comparing generated tokens (30 s)",
}

# Single tests in the full tier only: module -> test functions (every parametrization of each).
SLOW_TESTS = {
    "test_cli_bad_input": {
        "test_lm_eval_command_with_bad_model_args",  # an evalsuite-lm-eval subprocess each (230 s)
        "test_installed_evalsuite_command",  # the installed console script, a subprocess (20 s)
    },
    "test_eval_plan": {  # evalsuite eval runs of the shipped models end to end (90 s; two short ones stay)
        "test_speculative_predictors_sharing_one_generation_answer_as_each_alone",
        "test_a_vision_language_model_is_planned_too",
        "test_speculative_batched_generates_what_batch_one_does",
        "test_tasks_of_one_call_are_stored_as_if_each_ran_alone",
        "test_speculative_requests_are_batched_by_the_resident_lengths",
    },
    "test_evaluate_modules": {  # evaluate.load in fresh interpreters, all of HumanEval in the sandbox (95 s)
        "test_sandboxed_code_eval_scores_every_canonical_humaneval_solution_and_fails_wrong_ones",
        "test_expert_recall_module_counts_predicted_experts_among_the_routers",
        "test_sandboxed_code_eval_reports_timeouts_and_failures_like_code_eval",
    },
    "test_sweep": {  # sweeps of real cells, one on Ray (85 s)
        "test_an_interrupted_sweep_resumes_with_only_the_missing_cells",
        "test_local_and_ray_sweeps_store_the_same_results",
    },
    "test_bad_input": {
        "test_cli_calibrate_then_generate_with_the_artifact",  # trains and generates (55 s)
        "test_cli_errors_are_one_line_with_exit_code_2",  # subprocesses (15 s)
        "test_cli_generate_table",  # a generation under every mode (8 s)
    },
    "test_tiny_vl": {"test_specmoe_vlm_answers_exactly_as_hf_multimodal"},
    "test_recall_curve_cli": {"test_a_small_curve_is_stored_and_reported"},  # an evalsuite eval plan (45 s)  # two lm-eval runs (55 s)
    "test_benchmark_scorers": {"test_every_humaneval_canonical_solution_passes_and_wrong_ones_fail"},  # 30 s
    "test_code_verdicts": {  # many sandboxed programs (35 s)
        "test_patching_what_the_tests_use_or_reading_the_answers_scores_zero",
        "test_attacks_on_the_grader_score_zero_through_both_paths",
    },
    "test_eval_knobs": {
        "test_cache_and_store_options_reach_the_engine_and_the_stored_run",  # evalsuite eval runs (18 s)
        "test_eval_errors_name_the_commands_own_flags",  # subprocesses (6 s)
    },
    "test_cache_policies": {"test_victims_match_the_reference"},  # a property-based search (20 s)
    "test_cache_engine": {"test_demand_waits_for_wrong_prefetches_in_flight_instead_of_failing"},  # slow link (7 s)
    "test_perf": {
        "test_a_random_real_shape_model_has_the_real_expert_size",  # a real-shape layer (8 s)
        "test_a_recorded_trace_of_another_shape_gives_its_predicted_reuse_to_the_synthetic_one",  # 4 s
    },
    "test_eval_run_options": {"test_settings_reach_lm_eval_and_the_stored_run_and_tell_runs_apart"},  # 7 s
    "test_device_refusal": {"test_lm_eval_command_with_device_gets_one_line"},  # a subprocess (6 s)
    "test_sandbox_hostile": {"test_evaluation_mixing_hostile_and_correct_samples"},  # 6 s
}

# Architecture sweeps: in these modules a test parametrized by `model_type` runs in the default tier for
# these architectures only (a text one and a vision-language one), in the full tier for every one.
DEFAULT_ARCHITECTURES = {"qwen3_moe", "qwen3_vl_moe"}
ARCHITECTURE_SWEEPS = {"test_exactness", "test_controlled_recall", "test_quantised_experts", "test_late_copies", "test_lazy_link", "test_modes", "test_shadows",
                       "test_load_offloaded"}


def _slow(item) -> bool:
    module = item.path.stem
    if module in SLOW_MODULES or item.originalname in SLOW_TESTS.get(module, ()):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return module in ARCHITECTURE_SWEEPS and params.get("model_type", "qwen3_moe") not in DEFAULT_ARCHITECTURES


def _check_names(items) -> None:
    """A listed module or test that no longer exists would silently move nothing: refuse it."""
    here = Path(__file__).parent
    missing = [f"{name}.py" for name in (*SLOW_MODULES, *SLOW_TESTS, *ARCHITECTURE_SWEEPS)
               if not (here / f"{name}.py").is_file()]
    modules = {item.path.stem: item.module for item in items if hasattr(item, "module")}
    missing += [f"{module}.py::{test}" for module, tests in SLOW_TESTS.items() if module in modules
                for test in sorted(tests) if not hasattr(modules[module], test)]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py lists tests that do not exist: {', '.join(missing)}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    _check_names(items)
    for item in items:
        if _slow(item):
            item.add_marker(pytest.mark.slow)
