"""Which of vLLM's connector unit tests apply to ecd's connectors, and why (docs/vllm.md,
"vLLM's own connector tests", has the same lists in words).

How the list was made: every test under tests/v1/kv_connector/unit and tests/v1/ec_connector/unit
(and tests/v1/core/test_scheduler.py, whose connector tests make vLLM's real scheduler with the
example connectors) was run with ecd_upstream_plugin.py; the tests that constructed an ecd
connector (the plugin records it) are the candidates, and of those the ones below apply: they
test what any connector must do (the KV/EC connector API contract, vLLM's scheduler and model
runner driving a connector). The candidates left out assert on the example connectors' own
storage (files, safetensors, their metadata classes and private fields): NOT_APPLICABLE says so
for each. Tests that never construct a connector (NIXL, Mooncake, LMCache, MoRIIO, offloading,
the EPD proxy, vLLM's scheduler with a mock connector) test something else.
"""
from __future__ import annotations

NEWEST = "0.33.0"  # the vLLM whose tree the list below names

EC = "tests/v1/ec_connector/unit/test_ec_example_connector.py::"
KV = "tests/v1/kv_connector/unit/"
CORE = "tests/v1/core/test_scheduler.py::"

# vLLM 0.33: the connector unit tests that apply (node ids in vLLM's tree).
APPLICABLE_0_33 = [
    # The EC connector API: roles, lookups, saving, loading, metadata binding (ECConnectorBase).
    EC + "TestECExampleConnectorBasics::test_role_assignment",
    EC + "TestCacheExistence::test_has_cache_item_all_exist_3_items",
    EC + "TestCacheExistence::test_has_cache_item_none_exist",
    EC + "TestCacheExistence::test_has_cache_item_partial_exist",
    EC + "TestCacheExistence::test_has_cache_item_miss_creates_no_folder",
    EC + "TestCacheSaving::test_save_caches_consumer_skips",
    EC + "TestCacheLoading::test_start_load_caches_skip_existing",
    EC + "TestCacheLoading::test_start_load_caches_empty_metadata",
    EC + "TestMetadataBindingLifecycle::test_bind_connector_metadata",
    EC + "TestMetadataBindingLifecycle::test_clear_connector_metadata",
    EC + "TestMetadataBindingLifecycle::test_get_connector_metadata",
    EC + "TestMetadataBindingLifecycle::test_get_connector_metadata_not_set",
    EC + "TestEdgeCases::test_save_empty_cache",
    EC + "TestEdgeCases::test_has_cache_item_empty_request",
    # The KV connector in vLLM's model-runner mixin and inside MultiConnector.
    KV + "test_kv_connector_lifecycle.py::test_kv_connector_mixin_clears_metadata",
    KV + "test_multi_connector.py::test_multi_connector_handle_preemptions_integration",
    # vLLM's real scheduler with the connector (use_kv_connector / use_ec_connector).
    CORE + "test_abort_request_finished_recving",
    CORE + "test_abort_request_waiting_for_remote_kvs",
    CORE + "test_delayed_kv_connector_free_keeps_scheduler_active",
    CORE + "test_encoder_input_skipped_when_connector_already_has_the_item[ec_consumer]",
    CORE + "test_encoder_input_skipped_when_connector_already_has_the_item[ec_producer]",
    CORE + "test_encoder_instance_defers_stop_until_prompt_is_consumed",
    CORE + "test_encoder_instance_finishes_request_once_prompt_is_consumed",
    CORE + "test_kv_connector_handles_preemption[True-ec_consumer-False-False]",
    CORE + "test_kv_connector_handles_preemption[True-ec_consumer-False-True]",
    CORE + "test_kv_connector_handles_preemption[True-ec_consumer-True-False]",
    CORE + "test_kv_connector_handles_preemption[True-ec_consumer-True-True]",
    CORE + "test_prepend_skipped_requests_order",
    CORE + "test_priority_scheduling_preemption_and_resumption_when_out_of_kv[False-None-False]",
    CORE + "test_priority_scheduling_preemption_and_resumption_when_out_of_kv[False-None-True]",
    CORE + "test_priority_scheduling_preemption_and_resumption_when_out_of_kv[True-ec_consumer-False]",
    CORE + "test_priority_scheduling_preemption_and_resumption_when_out_of_kv[True-ec_consumer-True]",
]

ROLE_SPLIT = ("calls save_caches, a worker-side method (ECConnectorBase lists it under 'Worker-side "
              "methods'), on a SCHEDULER-role connector: vLLM's example connector is one object that "
              "does both, ecd's (like vLLM's NixlConnector) makes only its role's side, and a "
              "scheduler-role save is a no-op by design (tests/vllm/test_connector_roles.py). The same "
              "logic through the roles vLLM uses (a producer's worker saves, a consumer's scheduler "
              "finds) passes: tests/vllm/test_upstream_logic.py")

# Applicable tests ecd does not pass, with the reason (run.py fails on any other failure).
GAPS_0_33 = {
    EC + "TestCacheExistence::test_has_cache_item_all_exist_3_items": ROLE_SPLIT,
    EC + "TestCacheExistence::test_has_cache_item_partial_exist": ROLE_SPLIT,
}

EXAMPLE_FILES = "asserts on the example connector's files (paths, safetensors contents)"
EXAMPLE_STATE = "asserts on the example connector's private fields or its own metadata class"

# Tests that construct ecd's connector under the example's name but do not apply, and why.
NOT_APPLICABLE_0_33 = {
    EC + "TestECExampleConnectorBasics::test_initialization_producer": EXAMPLE_FILES + " (_storage_path)",
    EC + "TestECExampleConnectorBasics::test_initialization_consumer": EXAMPLE_FILES + " (_storage_path)",
    EC + "TestStateManagement::test_update_state_after_alloc_3_items": EXAMPLE_STATE + " (_mm_datas_need_loads)",
    EC + "TestStateManagement::test_build_connector_meta_3_items": EXAMPLE_STATE + " (ECExampleConnectorMetadata)",
    EC + "TestStateManagement::test_build_connector_meta_empty": EXAMPLE_STATE + " (ECExampleConnectorMetadata)",
    EC + "TestStateManagement::test_state_cleared_after_metadata_build": EXAMPLE_STATE + " (_mm_datas_need_loads)",
    EC + "TestCacheSaving::test_save_caches_producer_3_items": EXAMPLE_FILES + " (_generate_filename_debug)",
    EC + "TestCacheLoading::test_start_load_caches_pins_device_to_current_rank":
        "patches safetensors.torch.load_file, the example's loader, and asserts its device argument",
    EC + "TestCacheLoading::test_start_load_caches_non_cuda_platform_uses_device_type":
        "patches safetensors.torch.load_file, the example's loader, and asserts its device argument",
    EC + "TestFilenameGeneration::test_generate_foldername": EXAMPLE_FILES,
    EC + "TestFilenameGeneration::test_generate_filename": EXAMPLE_FILES,
    EC + "TestFilenameGeneration::test_generate_filename_consistency": EXAMPLE_FILES,
    EC + "TestEdgeCases::test_load_nonexistent_cache":
        "expects the example's FileNotFoundError from a load of a missing item; ecd never raises into "
        "the engine: the item is recomputed in the same step (docs/vllm.md, EC connector)",
    "tests/v1/ec_connector/unit/test_ec_connector_metrics.py::test_connector_hooks_default_to_none":
        "asserts that the connector reports no statistics ('no connector type overrides these yet'); "
        "whether one does is the connector's choice",
    "tests/v1/ec_connector/unit/test_ec_transfer_params.py::test_free_request_calls_ec_connector_and_surfaces_params":
        "replaces the scheduler's EC connector with a MagicMock before the part under test",
    "tests/v1/ec_connector/unit/test_ec_transfer_params.py::test_free_request_without_ec_connector_returns_none":
        "tests the scheduler without an EC connector",
    KV + "test_multi_connector.py::test_multi_example_connector_consistency":
        EXAMPLE_FILES + " (compares the two storage directories), and runs meta-llama/Llama-3.2-1B-Instruct "
        "(weights from the Hugging Face hub) in an LLM: not here",
    KV + "test_hma_auto_config.py::test_hma_auto_config[non_hma_connector]":
        "asserts that ExampleConnector does not support the hybrid allocator (a property of that class)",
    KV + "test_hma_auto_config.py::test_hma_auto_config[multi_mixed]":
        "asserts that ExampleConnector does not support the hybrid allocator (a property of that class)",
    KV + "test_hma_auto_config.py::test_explicit_hma_with_non_hma_connector_errors_at_factory":
        "asserts that ExampleConnector does not support the hybrid allocator (a property of that class)",
    CORE + "test_kv_connector_unable_to_allocate[True-ec_consumer]":
        EXAMPLE_STATE + " (reads ECExampleConnectorMetadata.mm_datas from the step's metadata)",
}


def applicable(version: str) -> list[str]:
    """The applicable tests of vLLM `version` (0.32's tree has the same ones, those it has)."""
    return list(APPLICABLE_0_33)


def gaps(version: str) -> dict[str, str]:
    return dict(GAPS_0_33)
