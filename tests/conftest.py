import os

import pytest

import batchrun  # noqa: F401  (routes MLX to OpenBLAS before mlx.core is imported)
from batchrun.models import RANDOM_DEMO_MODEL, load_model

# In tests the default model ("demo", or no --model) is the random-weight one, for module
# fixtures and subprocesses too; the `trained` fixture gives back the trained one.
os.environ["BATCHRUN_DEMO_MODEL"] = str(RANDOM_DEMO_MODEL)

# Every test file's layer, a marker (declared in pyproject.toml): `pytest -m engine` runs one.
# A file missing here fails collection, so a new file is placed when it is added.
LAYER = {
    # unit: pure logic against fakes
    "test_blas.py": "unit", "test_cache_hardening.py": "unit", "test_docs.py": "unit",
    "test_layout.py": "unit", "test_lint.py": "unit", "test_media.py": "unit",
    "test_media_policy.py": "unit", "test_media_walk.py": "unit",
    "test_model_fingerprint.py": "unit", "test_recovery_property.py": "unit",
    "test_rows.py": "unit", "test_train_kernels.py": "unit",
    # engine: the real MLX engine on the tiny bundled models
    "test_chat_template.py": "engine", "test_constrained.py": "engine",
    "test_tool_forms.py": "engine", "test_gguf.py": "engine",
    "test_contract_mlx_lm.py": "engine",
    "test_demo_model.py": "engine", "test_engine.py": "engine",
    "test_engine_backends.py": "engine", "test_engine_serving.py": "engine",
    "test_families.py": "engine",
    "test_faults.py": "engine", "test_gated_delta.py": "engine",
    "test_host_attention.py": "engine", "test_prefix_cache.py": "engine",
    "test_quantized.py": "engine",
    "test_reasoning.py": "engine", "test_request_fields.py": "engine",
    "test_shared_prefix.py": "engine", "test_shared_prefix_150m.py": "engine",
    "test_speculate.py": "engine", "test_tokens.py": "engine", "test_training.py": "engine",
    "test_vision.py": "engine", "test_vision_model.py": "engine",
    "test_vision_prefix_cache.py": "engine",
    # job: whole jobs run in-process (the Python API, the command through CliRunner)
    "test_api.py": "job", "test_bad_input.py": "job", "test_bench.py": "job",
    "test_contract_run_batch.py": "job", "test_contract_seed_engine.py": "engine",
    "test_csv_input.py": "job",
    "test_hostile_inputs.py": "job", "test_job.py": "job", "test_job_safety.py": "job",
    "test_parquet_output.py": "job", "test_report.py": "job",
    # e2e: the command line end to end, in a child process where exits and signals matter
    "test_cli.py": "e2e", "test_cli_contract.py": "e2e", "test_crash.py": "e2e",
    "test_exit.py": "e2e", "test_ray.py": "e2e",
    # gpu: the CUDA kernels and the GPU's paths; here without a GPU (NVRTC compiles, CUDA faked)
    "test_decode_attention.py": "gpu", "test_first_use.py": "gpu",
    "test_gated_delta_step.py": "gpu",
    "test_prefix_attention.py": "gpu",
}

# The slowest tests (file::function, every parametrization): `pytest -m "not slow"` leaves them
# out and still runs every layer and every feature (docs/dev/tests.md).
SLOW = {
    "test_bench.py::test_bench_runs_every_system_on_the_same_rows",
    "test_bench.py::test_workloads_have_the_documented_shapes",
    "test_cache_hardening.py::test_a_run_over_a_cache_damaged_every_way_matches_a_run_without_one",
    "test_cli.py::test_default_job_dir_and_output_option",
    "test_cli.py::test_results_do_not_depend_on_concurrency",
    "test_cli.py::test_the_job_runs_with_what_came_before_it_left_out_of_garbage_collection",
    "test_cli_contract.py::test_a_stdin_job_survives_ctrl_c_and_resumes_from_its_spooled_rows",
    "test_cli_contract.py::test_status_while_a_job_runs_counts_rows_finished_ahead_of_a_slow_row",
    "test_constrained.py::test_120_schema_rows_all_validate_and_share_the_batch_with_free_rows",
    "test_constrained.py::test_constrained_greedy_output_does_not_depend_on_batch_composition",
    "test_crash.py::test_ctrl_c_exits_130_and_resumes",
    "test_crash.py::test_status_works_while_the_job_runs",
    "test_decode_attention.py::test_greedy_tokens_do_not_change_when_decode_steps_take_row_ranges",
    "test_decode_attention.py::test_rows_holding_copies_of_cached_blocks_join_rows_without",
    "test_decode_attention.py::test_rows_under_shared_prefixes_decode_the_same_with_row_ranges",
    "test_decode_attention.py::test_the_kernels_source_compiles_to_ptx_with_the_launched_name",
    "test_engine_backends.py::test_a_shared_prefix_served_from_the_cache_gives_the_same_tokens",
    "test_exit.py::test_a_finished_run_exits_at_once_and_leaves_everything_written",
    "test_exit.py::test_a_run_started_with_a_standard_stream_closed_writes_its_results_alone",
    "test_exit.py::test_an_exit_code_is_kept_and_a_usage_error_still_says_why",
    "test_exit.py::test_the_normal_exit_on_request",
    "test_host_attention.py::test_the_engine_prefills_and_verifies_through_it_to_the_same_greedy_tokens",
    "test_hostile_inputs.py::test_a_process_limit_too_low_is_one_line",
    "test_hostile_inputs.py::test_sighup_stops_a_job_resumably_with_the_resume_line",
    "test_job.py::test_job_file_in_jobs_folder_labels_the_sample_reviews",
    "test_job.py::test_parquet_round_trip_keeps_columns_and_types",
    "test_job_safety.py::test_a_fifo_among_the_files_a_job_appends_to_is_one_line_not_a_hang",
    "test_job_safety.py::test_a_lock_that_is_not_a_file_is_never_written_through",
    "test_job_safety.py::test_ctrl_c_after_restart_hints_a_resume_that_keeps_progress",
    "test_job_safety.py::test_ctrl_c_while_the_job_starts_exits_130_without_a_traceback",
    "test_job_safety.py::test_rows_finished_behind_a_slow_row_survive_a_kill_and_are_not_computed_again",
    "test_job_safety.py::test_sigterm_stops_like_ctrl_c_with_exit_143",
    "test_media_policy.py::test_a_slow_drip_fails_at_the_deadline",
    "test_media_policy.py::test_ctrl_c_interrupts_a_hanging_fetch",
    "test_media_policy.py::test_rows_go_on_while_a_slow_input_is_still_being_read",
    "test_media_policy.py::test_text_rows_finish_long_before_a_hanging_image",
    "test_model_fingerprint.py::test_new_weights_behind_a_hub_id_are_a_different_model",
    "test_prefix_attention.py::test_greedy_tokens_do_not_change_when_the_prefix_part_takes_the_path",
    "test_prefix_cache.py::test_two_processes_share_one_cache_folder",
    "test_ray.py::test_a_killed_actor_has_its_slice_retried_and_every_row_is_done_once",
    "test_ray.py::test_a_local_cluster_ends_with_its_driver_and_a_killed_drivers_leftovers_are_reaped",
    "test_ray.py::test_a_row_too_deep_to_send_to_a_worker_is_that_rows_error",
    "test_ray.py::test_reaping_kills_the_recorded_sessions_processes_and_nothing_else",
    "test_ray.py::test_two_actors_give_the_single_process_output",
    "test_recovery_property.py::test_resume_after_any_kill_and_edit_gives_the_uninterrupted_files",
    "test_report.py::test_an_interrupted_then_resumed_job_totals_equal_the_sums_of_its_two_runs",
    "test_shared_prefix.py::test_a_row_holds_only_its_own_tokens_in_the_memory_budget",
    "test_shared_prefix.py::test_a_tail_that_fails_to_compute_leaves_the_rows_to_compute_it",
    "test_shared_prefix.py::test_cold_warm_and_damaged_disk_caches_give_the_same_tokens",
    "test_shared_prefix.py::test_greedy_tokens_are_the_same_as_without_a_prefix_cache",
    "test_shared_prefix.py::test_seeded_sampling_is_unchanged",
    "test_shared_prefix.py::test_tokens_rows_share_past_their_cached_blocks_are_computed_once",
    "test_shared_prefix_150m.py::test_the_150m_shape_gives_the_same_greedy_tokens_batched_or_alone",
    "test_shared_prefix_150m.py::test_the_150m_shape_gives_the_same_tokens_from_cold_warm_and_damaged_caches",
    "test_speculate.py::test_draft_model_speculation_gives_the_same_greedy_tokens",
    "test_speculate.py::test_rows_holding_copies_of_cached_blocks_speculate_to_the_same_tokens",
    "test_speculate.py::test_rows_joining_or_leaving_while_a_verification_runs_ahead_keep_their_tokens",
    "test_speculate.py::test_rows_sharing_a_cached_prefix_speculate_to_the_same_tokens",
    "test_speculate.py::test_rows_with_min_tokens_or_logit_bias_speculate_to_the_same_tokens",
    "test_speculate.py::test_seeded_sampling_gives_the_same_tokens_with_speculation",
    "test_speculate.py::test_the_trained_pair_keeps_most_guesses_on_essays_and_n_grams_on_references",
    "test_training.py::test_the_trained_demo_answers_the_sample_questions_with_its_lessons",
    "test_training.py::test_the_trained_demo_labels_the_sample_reviews_and_calls_the_sample_tool",
    "test_training.py::test_the_trained_demo_writes_its_essays_and_quotes_its_references",
    "test_training.py::test_training_is_deterministic_from_its_seed_and_lowers_the_loss",
    "test_vision.py::test_job_file_describes_the_sample_images",
    "test_vision_prefix_cache.py::test_a_shared_system_prompt_is_served_from_the_cache_with_identical_outputs",
}


def pytest_collection_modifyitems(config, items):
    unplaced = sorted({item.path.name for item in items} - LAYER.keys())
    if unplaced:
        raise pytest.UsageError(f"{', '.join(unplaced)}: no layer; add each to LAYER in "
                                "tests/conftest.py (unit, engine, job, e2e or gpu)")
    for item in items:
        item.add_marker(LAYER[item.path.name])
        if f"{item.path.name}::{item.originalname}" in SLOW:
            item.add_marker("slow")


@pytest.fixture(scope="session")
def demo():
    """The demo tokenizer with random weights, loaded once through mlx_lm.load: in tests the
    default model ("demo", or no --model) is this one, whose rows run to their max_tokens."""
    return load_model(str(RANDOM_DEMO_MODEL))


@pytest.fixture
def trained(monkeypatch):
    """The trained demo model as the default model, as users get it; loaded."""
    monkeypatch.delenv("BATCHRUN_DEMO_MODEL", raising=False)
    return load_model(None)


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Keep caches and job folders of a test inside its own temporary folder; the random
    demo model is the default one."""
    monkeypatch.setenv("BATCHRUN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHRUN_DEMO_MODEL", str(RANDOM_DEMO_MODEL))
