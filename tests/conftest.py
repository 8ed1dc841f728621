"""Shared test set-up, and the ``slow`` marker behind ``make test-fast``.

``make test`` runs everything (about 7 minutes on 2 cores); ``make test-fast`` runs
``-m "not slow"`` (under 2 minutes): every test function below took more than ~1.5 s
(multi-rank training runs, the trainer end to end, checkpoints on disk, measured
memory). A new test is fast unless it is added here; keep the fast lane under 2 minutes
(``pytest -m "not slow" --durations=20`` shows what to move).

It also keeps CUDA out of the CPU lane on machines that have a GPU (tests/lanes.py);
``make test-gpu`` runs the CUDA lane, tests/gpu.
"""

import os
import pathlib
import sys

import pytest

# Tests in subfolders (tests/conformance) import helpers of tests/ by module name, e.g.
# ``from test_error_catalogue import matches_documented``.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import lanes  # noqa: E402 - found through the path set just above

# The CPU lane runs as on a machine without a GPU, whatever the machine (see tests/lanes.py).
# Done when this file is imported: before any test imports torch and asks CUDA anything.
if not lanes.is_cuda_lane(os.environ):
    lanes.hide_cuda(os.environ)


SLOW = {
    "tests/test_whole_matrix.py::test_adafactor_steps_whole_matrices_exactly",
    "tests/test_train_loop.py::test_muon_trains_and_resumes_exactly",
    "tests/test_whole_matrix.py::test_muon_steps_sharded_matrices_as_one_process",
    "tests/test_whole_matrix.py::test_a_muon_checkpoint_resumes_exactly",
    "tests/test_whole_matrix.py::test_a_registered_whole_matrix_optimizer_steps_as_one_process",
    "tests/test_whole_matrix.py::test_what_cannot_be_stepped_whole_is_refused_at_the_first_step",
    "tests/test_runtime.py::test_a_dropped_forward_does_not_hold_back_reductions",
    "tests/test_rank_dependent_paths.py::test_experts_without_tokens_on_some_ranks_train_like_one_process",
    "tests/test_rank_dependent_paths.py::test_branches_and_root_parameters_used_on_some_ranks_train_like_one_process",
    "tests/test_rank_dependent_paths.py::test_every_combination_trains_like_one_process",
    "tests/test_rank_dependent_paths.py::test_every_combination_at_four_ranks_trains_like_one_process",
    "tests/test_rank_dependent_paths.py::test_a_layer_dropped_on_one_rank_is_named_on_every_rank",
    "tests/test_rank_dependent_paths.py::test_reductions_in_different_orders_are_named_before_the_optimizer_sees_them",
    "tests/test_rank_dependent_paths.py::test_a_rank_that_is_only_slow_is_waited_for",
    "tests/test_train_loop.py::test_moe_preset_trains_like_one_process",
    "tests/test_rank_dependent_paths.py::test_unused_as_zeros_trains_as_torch_fsdp2_does",
    "tests/test_rank_dependent_paths.py::test_quantized_tensor_subclass_experts_train_like_one_process",
    "tests/test_memory_measured.py::test_mixture_of_experts_estimate_within_10_percent_of_measured_peak",
    "tests/test_quantized_allgather.py::test_int8_subclass_trains_like_one_process_with_its_hooks_on_every_gather",
    "tests/test_quantized_allgather.py::test_nf4_qlora_trains_like_one_process",
    "tests/test_quantized_allgather.py::test_quantized_weights_with_cpu_offload_train_like_one_process",
    "tests/test_quantized_allgather.py::test_float8_weights_gather_in_float8_and_train_like_one_process",
    "tests/test_quantized_allgather.py::test_losses_and_bytes_match_torch_fsdp2_on_the_same_script",
    "tests/test_quantized_allgather.py::test_a_checkpoint_with_quantized_shards_resumes_where_it_left_off",
    "tests/test_quantized_allgather.py::test_misuse_is_one_line_naming_the_parameter_on_every_rank",
    "tests/test_quantized_allgather.py::test_no_sync_accumulation_and_kept_gathers_match_one_process",
    "tests/test_quantized_allgather.py::test_to_loads_and_explicit_unshard_keep_the_quantized_model",
    "tests/test_train_qlora.py::test_qlora_trains_only_the_adapters_over_a_sharded_nf4_base",
    "tests/test_train_qlora.py::test_qlora_at_two_ranks_trains_as_one_process_on_the_same_batches",
    "tests/test_train_qlora.py::test_qlora_composes_with_cpu_offload_checkpointing_and_bf16",
    "tests/test_train_qlora.py::test_a_qlora_run_resumed_from_its_checkpoint_continues_like_a_straight_run",
    "tests/test_projection.py::test_calibrated_projection_of_this_machine",
    "tests/test_projection.py::test_projection_compares_with_fullshard_runs_on_this_cpu",
    "tests/conformance/test_fsdp2_behaviour.py::test_a_list_of_modules_is_one_unit",
    "tests/conformance/test_fsdp2_behaviour.py::test_mixed_reshard_after_forward_settings_finish_and_match",
    "tests/conformance/test_fsdp2_behaviour.py::test_requires_all_reduce_false_accumulates_within_the_shard_group",
    "tests/conformance/test_fsdp2_behaviour.py::test_shard_placement_fn_shards_on_other_dims",
    "tests/conformance/test_fsdp2_behaviour.py::test_torch_compile_trains_with_the_eager_losses",
    "tests/conformance/test_fsdp2_behaviour.py::test_torch_compile_with_inductor",
    "tests/conformance/test_fsdp2_behaviour.py::test_torchs_policy_objects_are_accepted",
    "tests/conformance/test_real_callers.py::test_lightning_model_parallel_strategy_trains_as_single_process",
    "tests/conformance/test_real_callers.py::test_run_module_installs_before_the_program_imports_torchs_names",
    "tests/conformance/test_real_callers.py::test_transformers_fsdp2_path_runs_on_fullshard_unchanged",
    "tests/conformance/test_real_callers.py::test_accelerate_fsdp2_prepare_model_runs_on_fullshard_unchanged",
    "tests/conformance/test_tensor_parallel.py::test_dp_mesh_dims_on_the_whole_mesh_matches_single_process",
    "tests/conformance/test_tensor_parallel.py::test_fsdp_with_tensor_parallel_matches_single_process",
    "tests/conformance/test_tensor_parallel.py::test_misuse_names_the_parameter_and_what_to_do",
    "tests/test_activation_checkpointing.py::test_checkpointing_composes_with_sharding",
    "tests/test_benchmarks.py::test_gpu_benchmark_runs_each_implementation_to_the_same_losses",
    "tests/test_gpu_check.py::test_the_gpu_check_runs_every_step_on_cpu",
    "tests/test_copy_streams.py::test_a_custom_reduce_scatters_input_lives_until_its_collective_finishes",
    "tests/test_one_rank_collectives.py::test_one_rank_issues_its_collectives_and_trains_like_one_process",
    "tests/test_gpu_paths.py::test_clipping_offloaded_gradients_matches_one_process",
    "tests/test_benchmarks.py::test_disk_offload_benchmark_reports_time_throughput_and_memory",
    "tests/test_disk_offload.py::test_disk_offload_steps_exactly_as_cpu_offload",
    "tests/test_benchmarks.py::test_quantized_comm_benchmark_counts_bytes_per_setting",
    "tests/test_quantized_comm.py::test_quantized_collectives_send_a_byte_per_element_and_train_alike",
    "tests/test_quantized_comm.py::test_quantized_communication_resumes_exactly",
    "tests/test_memory_measured.py::test_quantized_communication_estimate_within_10_percent_of_measured_peak",
    "tests/test_memory.py::test_estimate_and_plan_with_int8_communication",
    "tests/test_disk_offload.py::test_parameters_on_disk_train_exactly_and_give_their_pages_back",
    "tests/test_train_loop.py::test_quantized_communication_trains_within_a_percent_of_full_precision",
    "tests/test_disk_offload.py::test_disk_offload_parity_with_one_process",
    "tests/test_disk_offload.py::test_disk_offload_resumes_from_a_checkpoint_and_a_state_dict",
    "tests/test_disk_offload.py::test_disk_offload_resumes_a_model_with_empty_shards",
    "tests/test_optim.py::test_rprop_and_asgd_step_on_shards_like_one_process",
    "tests/test_optim.py::test_optimizers_that_cannot_step_shards_are_refused_at_the_first_step",
    "tests/test_train_reliability.py::test_workers_killed_mid_step_and_in_a_save_restart_and_leave_nothing_on_disk",
    "tests/test_memory.py::test_plan_puts_optimizer_states_on_disk_when_the_host_is_the_limit",
    "tests/test_benchmarks.py::test_trainer_benchmark_times_the_trainer_beside_a_plain_loop",
    "tests/test_checkpoint.py::test_async_save_writes_the_state_at_the_call",
    "tests/test_cli_numbers.py::test_estimate_numbers_are_accepted_or_refused_in_one_line",
    "tests/test_cli_numbers.py::test_plan_numbers_are_accepted_or_refused_in_one_line",
    "tests/test_cli_numbers.py::test_train_numbers_are_accepted_or_refused_in_one_line",
    "tests/test_checkpoint_faults.py::test_damaged_checkpoints_are_refused_by_name_or_read_exactly",
    "tests/test_checkpoint_faults.py::test_kill_9_during_saves_leaves_the_latest_checkpoint_loadable",
    "tests/test_checkpoint_interop.py::test_a_bare_state_dict_saved_by_torch_loads_at_another_world_size",
    "tests/test_checkpoint_interop.py::test_a_plain_module_checkpoint_resumes_in_fullshard_as_in_one_process",
    "tests/test_checkpoint_interop.py::test_a_torch_fsdp2_checkpoint_resumes_in_fullshard_as_in_torch",
    "tests/test_checkpoint_interop.py::test_torch_dcp_alone_loads_a_fullshard_checkpoint_into_a_plain_module",
    "tests/test_train_loop.py::test_compiled_blocks_train_the_eager_model",
    "tests/test_train_cli.py::test_a_resume_refuses_what_it_would_otherwise_ignore",
    "tests/test_checkpoint.py::test_cli_inspect_and_streamed_safetensors_export",
    "tests/test_checkpoint.py::test_corrupt_missing_and_incompatible_checkpoints_are_named",
    "tests/test_checkpoint.py::test_exact_resume_in_fresh_processes",
    "tests/test_checkpoint.py::test_killed_save_leaves_previous_checkpoint_in_use",
    "tests/test_checkpoint.py::test_load_at_another_world_size_or_layout",
    "tests/test_checkpoint.py::test_load_into_plain_module_on_one_process",
    "tests/test_checkpoint.py::test_state_dict_functions_full_sharded_broadcast",
    "tests/test_checkpoint.py::test_torch_dcp_loads_the_checkpoint_into_fsdp2",
    "tests/test_divergence.py::test_without_debug_a_timed_out_collective_names_the_unit",
    "tests/test_fsdp1_api.py::test_hybrid_shard_from_an_intra_inter_process_group_pair",
    "tests/test_fsdp1_api.py::test_process_group_and_device_mesh_arguments",
    "tests/test_fsdp1_strategies.py::test_hybrid_shards_within_node_and_all_reduces_across",
    "tests/test_fsdp1_strategies.py::test_prefetch_options_parity",
    "tests/test_fsdp1_strategies.py::test_shard_grad_op_does_not_gather_in_backward",
    "tests/test_fsdp1_strategies.py::test_strategy_parity",
    "tests/test_fsdp_seed_flows.py::test_hf_opt_fine_tuning_flow",
    "tests/test_fsdp_seed_flows.py::test_tutorial_fsdp1_flow",
    "tests/test_harness.py::test_a_segfaulting_rank_reports_where_it_died",
    "tests/test_hybrid.py::test_hybrid_parity_2x2",
    "tests/test_hybrid.py::test_hybrid_state_dicts_and_checkpoints",
    "tests/test_hybrid.py::test_reshard_after_forward_int_gathers_within_the_smaller_group",
    "tests/test_hybrid.py::test_reshard_after_forward_int_parity",
    "tests/test_lanes.py::test_the_cpu_lane_hides_cuda_from_tests_ranks_and_subprocesses",
    "tests/test_memory.py::test_plan_takes_the_cheapest_configuration_that_fits",
    "tests/test_memory.py::test_strategies_checkpointing_and_world_size_order_the_peaks",
    "tests/test_memory_measured.py::test_estimate_within_10_percent_of_measured_peak",
    "tests/test_memory_measured.py::test_bf16_estimate_counts_the_fp32_loss",
    "tests/test_memory_measured.py::test_planned_configuration_runs_under_its_budget",
    "tests/test_meta_init.py::test_meta_init_then_train",
    "tests/test_mixed_precision.py::test_accumulation_without_sync_in_reduce_dtype",
    "tests/test_mixed_precision.py::test_losses_match_fsdp2_with_the_same_policy",
    "tests/test_multinode.py::test_a_node_with_another_config_is_named_on_every_node",
    "tests/test_multinode.py::test_a_worker_killed_on_the_second_node_restarts_both_from_the_checkpoint",
    "tests/test_multinode.py::test_an_out_that_only_its_own_node_sees_stops_at_the_first_save",
    "tests/test_multinode.py::test_full_shard_over_two_nodes_matches_one_process",
    "tests/test_multinode.py::test_hybrid_shard_under_slurm_shards_in_a_node_and_replicates_across",
    "tests/test_multinode.py::test_nodes_that_never_meet_give_up_after_the_join_timeout",
    "tests/test_multinode.py::test_pods_of_a_pytorchjob_are_workers",
    "tests/test_multinode.py::test_resume_on_one_node_continues_a_two_node_run",
    "tests/test_offload.py::test_offload_with_each_strategy_parity",
    "tests/test_optim.py::test_local_step_matches_dtensor_step_bitwise",
    "tests/test_parity.py::test_parity",
    "tests/test_prefetch.py::test_seed_explicit_prefetch_example",
    "tests/test_resume_live.py::test_apply_after_training_keeps_one_storage",
    "tests/test_resume_live.py::test_fsdp1_load_into_the_live_model_trains_on_exactly",
    "tests/test_resume_live.py::test_guard_and_loads_that_do_not_fit",
    "tests/test_resume_live.py::test_load_into_the_live_model_trains_on_exactly",
    "tests/test_resume_live.py::test_load_into_the_live_model_without_the_local_step",
    "tests/test_runtime.py::test_clip_grad_norm_and_state_dict",
    "tests/test_runtime.py::test_steady_state_allocates_no_communication_buffers",
    "tests/test_schedule_drift.py::test_replay_makes_the_runtime_schedule",
    "tests/test_train_cli.py::test_ctrl_c_saves_a_checkpoint_and_exits_cleanly",
    "tests/test_train_cli.py::test_resume_continues_exactly_like_one_straight_run",
    "tests/test_train_hf.py::test_fine_tune_a_llama_with_its_tokenizer_then_generate_with_transformers",
    "tests/test_train_hf.py::test_fine_tune_tiny_llama_and_gpt2_from_local_folders",
    "tests/test_train_loop.py::test_bf16_and_fp16_train_close_to_fp32",
    "tests/test_train_loop.py::test_data_dependent_errors_name_the_field",
    "tests/test_train_loop.py::test_strategies_accumulation_and_recomputation_train_the_same_model",
    "tests/test_train_reliability.py::test_a_training_that_stops_being_finite_ends_the_run_without_saving",
    "tests/test_train_reliability.py::test_worker_killed_inside_a_save_leaves_the_previous_checkpoint",
    "tests/test_train_soak.py::test_memory_stays_flat_and_every_checkpoint_loads",
    "tests/test_train_units.py::test_loss_plot_is_a_png_of_the_asked_size_with_both_curves",
    "tests/test_wrap.py::test_auto_wrap_and_policy_parity",
}


# The multi-node lane (2 launchers x 2 ranks each, ~3 minutes on 2 cores): left out of
# `make test` to keep it under 10 minutes, run by `make test-multinode`; CI runs both.
MULTINODE_FILES = ("tests/test_multinode.py",)


# More combinations than `make test` has time for (each a minute or more on 2 cores): left
# out of `make test`, run by `make test-extended`; CI runs it after the multi-node lane.
EXTENDED = {
    "tests/test_rank_dependent_paths.py::test_compiled_blocks_with_rank_dependent_experts_train_like_one_process",
    "tests/test_rank_dependent_paths.py::test_every_combination_at_four_ranks_trains_like_one_process",
    "tests/test_train_loop.py::test_moe_preset_trains_like_one_process",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith(MULTINODE_FILES):
            item.add_marker(pytest.mark.multinode)
        if item.nodeid.split("[")[0] in EXTENDED:
            item.add_marker(pytest.mark.extended)


def pytest_configure(config):
    if not lanes.is_cuda_lane(os.environ) and lanes.cuda_was_already_initialized():
        raise pytest.UsageError(
            "tests/conftest.py: CUDA was initialized before the CPU lane could hide it (a "
            "plugin or conftest used torch.cuda first); run with CUDA_VISIBLE_DEVICES= set.")
    config.addinivalue_line("markers", "slow: left out of `make test-fast` (see conftest.py)")
    config.addinivalue_line("markers", "soak: long runs, left out of `make test`; `make soak`")
    config.addinivalue_line("markers", "multinode: the multi-node lane, `make test-multinode`")
    config.addinivalue_line("markers", "extended: more combinations, `make test-extended`")
