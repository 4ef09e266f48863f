"""Conformance suites, parametrised over every registered entry of a kind.

A third-party plugin gets the same checks by calling these from its own tests::

    from gemzoo.testing import attention_cases, check_attention
    @pytest.mark.parametrize("case", attention_cases(MY_KERNEL.capabilities), ids=str)
    def test_conformance(case):
        check_attention(MY_KERNEL, case, device="cpu")
"""

# The suites, one module per kind (gemzoo.kinds lists which), imported on first use: importing gemzoo.testing (or
# gemzoo.testing.pytest_plugin) loads no kernel library, so a test session can pick Triton's backend first.
_SUITES = {
    "gemzoo.testing.attention": ("AttentionCase", "attention_cases", "check_attention", "random_jagged_lengths"),
    "gemzoo.testing.batching": ("BatchingCase", "batching_cases", "check_assignment", "check_global_loss"),
    "gemzoo.testing.comms": ("check_comms_on_gloo",),
    "gemzoo.testing.memory": ("check_memory_policy",),
    "gemzoo.testing.models": ("check_dataset", "check_model"),
    "gemzoo.testing.planner": ("check_planner_local", "check_planner_on_gloo", "check_planner_protocol_on_gloo"),
    "gemzoo.testing.precision": ("check_precision_apply", "check_precision_linear", "precision_linear_cases"),
}

# Names a plugin's tests and benchmarks use beside gemzoo.api, from modules above the plugin layer; imported on
# first use so that collecting a test file does not build the trainer.
_LAZY = {
    "cli_main": ("gemzoo.cli", "main"),
    "SyntheticGemConfig": ("gemzoo.data.synthetic", "SyntheticGemConfig"),
    "SyntheticGemDataset": ("gemzoo.data.synthetic", "SyntheticGemDataset"),
    "gem_lognormal_lengths": ("gemzoo.data.synthetic", "gem_lognormal_lengths"),
    "config_changes": ("gemzoo.train.resume", "config_changes"),
    "select_attention": ("gemzoo.train.trainer", "select_attention"),
    "kernel_ms": ("gemzoo.profiling", "kernel_ms"),
    "gpu_idle": ("gemzoo.profiling", "gpu_idle"),
    "cuda_graph": ("gemzoo.profiling", "cuda_graph"),
    "annotations_ms": ("gemzoo.profiling", "annotations_ms"),
    "extension_available": ("gemzoo.ops", "extension_available"),
    # the batching exchange's phases, for benchmarks of its host work
    "route": ("gemzoo.data.exchange", "route"),
    "Planned": ("gemzoo.data.lookahead", "Planned"),
    "move": ("gemzoo.data.lookahead", "move"),
    "CompileWatch": ("gemzoo.train.compiles", "CompileWatch"),
    **{name: (module, name) for module, names in _SUITES.items() for name in names},
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gemzoo.testing' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value

# the suites (gemzoo.testing.pytest_plugin parametrises over entries) and the harness helpers, loaded on first use
__all__ = ["skip_unless_torchrec", *sorted(_LAZY)]


def skip_unless_torchrec() -> None:
    """Skip the calling test when the sparse side would not use torchrec (not installed, or
    ``GEMZOO_NO_TORCHREC`` set), as on the GPU image."""
    import pytest

    from gemzoo.embedding import torchrec_available

    if not torchrec_available():
        pytest.skip("needs torchrec (not installed, or GEMZOO_NO_TORCHREC is set)")
