"""Parametrized cases that ``make test`` leaves to ``make test-all`` (marked ``slow`` by
tests/conftest.py), so that ``make test`` stays near 15 minutes on 2 cores.

Each family keeps, in ``make test``, at least one case per stage, layout and precision it
checks; the cases listed here repeat a family's check on another optimizer, mesh size,
direction or flag set. The figures beside each group are worker seconds on the 2-core machine
(``pytest --durations=0``, docs/benchmarks.md "Test suite time"). A listed id that its test no
longer has is an error at collection (tests/conftest.py), so the list cannot go stale quietly.
"""

SLOW_CASES = (
    # the EMA's kernels at stages 0 and 2 (stage 3 stays): 194 s
    "tests/test_gpu.py::test_gpu_ema_in_the_compiled_step_adds_a_handful_of_kernels[0]",
    "tests/test_gpu.py::test_gpu_ema_in_the_compiled_step_adds_a_handful_of_kernels[2]",
    # the compiled-step theory at bf16 for stages 0, 1, 3 and fp32 per layer: 31 s
    "tests/test_gpu.py::test_gpu_compiled_step_matches_zero_theory[0-bf16]",
    "tests/test_gpu.py::test_gpu_compiled_step_matches_zero_theory[1-bf16]",
    "tests/test_gpu.py::test_gpu_compiled_step_matches_zero_theory[3-bf16]",
    "tests/test_gpu.py::test_gpu_compiled_step_matches_zero_theory[3_per_layer-fp32]",
    "tests/test_gpu.py::test_gpu_ema_of_350_leaves_is_a_handful_of_kernels_at_12_bytes_per_element[0]",
    "tests/test_gpu.py::test_gpu_plan_cli_prints_stage2_per_layer_hidden_share[1]",
    "tests/test_gpu.py::test_gpu_stage2_per_layer_hides_the_layers_reduce_scatters[1]",
    "tests/test_gpu.py::test_gpu_plan_without_compute_copy_compiles_and_estimates_fsdps_layout",
    "tests/test_gpu.py::test_gpu_vocab_parallel_moves_activations_instead_of_the_table",
    "tests/test_gpu.py::test_gpu_plan_vocab_parallel_keeps_the_table_sharded_at_stage_3_only",
    "tests/test_gpu_offload.py::test_gpu_offload_moves_the_state_from_device_to_host_memory[1]",
    "tests/test_gpu_offload.py::test_gpu_offload_moves_the_state_from_device_to_host_memory[2]",
    # the overlap benchmark's table (16 deviceless compiles; tests/test_gpu.py pins the same
    # hidden shares per stage): 149 s
    "tests/test_benchmarks.py::test_overlap_benchmark_rows_match_the_formulas",
    # equivalence with single-device optax: the transformer on a second optimizer per stage
    # (every stage stays on both models): 73 s
    "tests/test_zero.py::test_matches_single_device_optax[transformer-adafactor-1-1-4]",
    "tests/test_zero.py::test_matches_single_device_optax[transformer-clip_adam-2-1-1]",
    "tests/test_zero.py::test_matches_single_device_optax[transformer-lamb-0-1-1]",
    "tests/test_zero.py::test_matches_single_device_optax[transformer-multisteps_adam-2-2-4]",
    "tests/test_zero.py::test_matches_single_device_optax[transformer-adamw_masked-1-2-1]",
    "tests/test_zero.py::test_matches_single_device_optax[transformer-sgd_nesterov_cosine-1-8-4]",
    # per layer: the second optimizer and N = 2 (clip_adamw at N = 8 stays for every stage)
    "tests/test_layers.py::test_per_layer_matches_single_device[sgd_nesterov_cosine-2-4-0]",
    "tests/test_layers.py::test_per_layer_matches_single_device[sgd_nesterov_cosine-2-4-1]",
    "tests/test_layers.py::test_per_layer_matches_single_device[sgd_nesterov_cosine-2-4-2]",
    "tests/test_layers.py::test_per_layer_matches_single_device[sgd_nesterov_cosine-8-1-3]",
    "tests/test_layers.py::test_per_layer_matches_single_device[clip_adamw-2-4-3]",
    "tests/test_layers.py::test_per_layer_on_a_hybrid_mesh_matches_single_device[1]",
    "tests/test_layers.py::test_per_layer_on_a_hybrid_mesh_matches_single_device[2]",
    "tests/test_layers.py::test_stage2_reduce_scatters_each_layer_in_the_backward_loop[1]",
    # scan_layers: stage 3 at other layer counts and meshes (every stage stays)
    "tests/test_scan_layers.py::test_scan_layers_matches_single_device[3-1-8-1]",
    "tests/test_scan_layers.py::test_scan_layers_matches_single_device[3-2-8-1]",
    "tests/test_scan_layers.py::test_scan_layers_matches_single_device[3-5-2-2]",
    "tests/test_scan_layers.py::test_scan_layers_per_layer_outputs_match_single_device[3-2]",
    "tests/test_scan_layers.py::test_scan_layers_per_layer_outputs_match_single_device[3-4]",
    "tests/test_scan_layers.py::test_scan_layers_per_layer_inputs_match_single_device[keys-3]",
    # offload: stage 1 with micro-batches, stage 3 per layer without the fp32 reduce, the
    # offloaded -> device restore (device -> offloaded stays)
    "tests/test_offload.py::test_offload_trains_like_the_device_state[stage1_bf16_accum]",
    "tests/test_offload.py::test_offload_trains_like_the_device_state[stage3_per_layer_bf16]",
    "tests/test_offload.py::test_checkpoints_restore_across_offload_settings_and_continue[offloaded_to_device]",
    # the bucketed EMA's row layouts at stages 0 and 2 (stage 3 stays)
    "tests/test_ema_bucket.py::test_several_rows_equal_per_leaf_bitwise[0]",
    "tests/test_ema_bucket.py::test_several_rows_equal_per_leaf_bitwise[2]",
    # no compute copy: whole-model and hybrid (per layer stays), one restore direction
    "tests/test_compute_copy.py::test_no_copy_trains_like_the_copy[whole]",
    "tests/test_compute_copy.py::test_no_copy_trains_like_the_copy[hybrid]",
    "tests/test_compute_copy.py::test_checkpoints_restore_across_the_two_layouts_and_continue[no_copy_to_copy]",
    "tests/test_checkpoint_damage.py::test_failed_save_reaches_the_caller_and_the_previous_step_restores[async_wait]",
    "tests/test_vocab_parallel.py::test_vocab_parallel_bf16_is_as_close_to_fp32_optax_as_the_gathered_table",
    # the unscanned decoders: the GPT's remat loop against the scan (its no-remat loop and the
    # LLaMA stay), the NNX twin of the no-remat GPT
    # the NNX twin against the GSPMD-FSDP peer (the Linen loop stays)
    "tests/test_units.py::test_gpu_units_against_the_gspmd_fsdp_peer[nnx]",
    "tests/test_units_models.py::test_python_loop_loss_equals_the_scanned_decoder_on_the_same_weights[gpt-python]",
    "tests/test_units_models.py::test_nnx_list_loss_equals_the_linen_loop_on_the_same_weights[gpt-python_noremat]",
)
