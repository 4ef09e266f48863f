"""A pytest plugin for conformance tests: parametrisation over every registered entry of a kind.

Load it from a root ``conftest.py`` (gemzoo's does) or a plugin's own, or with ``-p gemzoo.testing.pytest_plugin``
in the plugin's pytest ``addopts`` (each plugin under ``plugins/`` does). Loaded, it picks Triton's backend (the
interpreter on a machine without CUDA) and registers gemzoo's test markers (``gpu``, ``slow``, ``multiprocess``)::

    pytest_plugins = ["gemzoo.testing.pytest_plugin"]

Then a test that takes an argument ``<kind>_name`` runs once per registered entry of that kind (``attention_name``,
``precision_name``, ``planner_name``, ``comms_name``, ``memory_name``, ``batching_name``, ``model_name``,
``dataset_name``), ids being the names, and ``registry_entry(kind, name)`` returns the entry::

    def test_my_invariant(memory_name, registry_entry):
        policy = registry_entry("memory", memory_name)

``registered(kind, device=..., pattern=...)`` gives the same list for an explicit ``parametrize`` (and filters by
the devices an entry's ``capabilities`` declare). A third-party plugin's tests run the suites of
``gemzoo.testing.<kind>`` on its own entry the same way, or over ``registered(kind, pattern="mine*")``.
"""

from __future__ import annotations

import pytest

from gemzoo.testing.interpreter import select_triton_backend

select_triton_backend()  # first: a plugin's own run (its folder the rootdir) has no root conftest to do it

from gemzoo.kinds import KINDS  # noqa: E402


def registered(kind: str, *, device: str | None = None, pattern: str | None = None) -> list:
    """``pytest.param(name, id=name)`` for each registered ``kind`` entry (those declaring ``device`` in their
    ``capabilities.devices`` when ``device`` is given; entries without capabilities run anywhere)."""
    from gemzoo import registry  # loads every plugin (Triton too): not before the root conftest picks the backend

    out = []
    for name in registry.names(kind, pattern):
        devices = getattr(getattr(registry.get(kind, name), "capabilities", None), "devices", None)
        if device is not None and devices is not None and device not in devices:
            continue
        out.append(pytest.param(name, id=name))
    return out


@pytest.fixture
def registry_entry():
    """``registry_entry(kind, name)``: the registered object (a fresh configured copy when it has options)."""
    from gemzoo import registry  # as in registered(): plugins load after the root conftest

    def get(kind: str, name: str):
        obj = registry.get(kind, name)
        options_cls = getattr(obj, "options_cls", None)
        if options_cls is None:
            return obj
        try:
            defaults = options_cls()
        except TypeError:  # options without defaults: the registered object as it is
            return obj
        return obj.configure(defaults)

    return get


def pytest_generate_tests(metafunc) -> None:
    for kind in KINDS:
        arg = f"{kind.name}_name"
        if arg in metafunc.fixturenames and not _already_parametrized(metafunc, arg):
            metafunc.parametrize(arg, registered(kind.name))


def _already_parametrized(metafunc, arg: str) -> bool:
    return any(arg in (m.args[0] if isinstance(m.args[0], (list, tuple)) else m.args[0].replace(" ", "").split(","))
               for m in metafunc.definition.iter_markers("parametrize"))


@pytest.fixture(scope="session", autouse=True)
def _interpreter_groups(request):
    """Start the Triton interpreter groups of every selected test module that names them (``INTERPRETER_GROUPS``
    beside ``SCRIPT``) when the run's first test starts, so they run in the background while other tests
    do; kill whatever still runs when the run ends (normally, on a failure with ``-x``, or on Ctrl-C). Never
    during collection: ``--collect-only`` starts no subprocess, and deselected modules (``-m "not slow"``)
    start none."""
    from gemzoo.testing.interpreter import start_groups, stop_all  # only when a run selects interpreter tests

    seen = set()
    for item in request.session.items:
        module = getattr(item, "module", None)
        groups = getattr(module, "INTERPRETER_GROUPS", None)
        if groups and module not in seen:
            seen.add(module)
            start_groups(module.SCRIPT, groups)
    yield
    stop_all()


MARKERS = (
    "gpu: needs a CUDA device (skipped, with the reason, on a machine without one)",
    "slow: takes more than about 2 s on a 2-core CPU (left out of the quick tier, -m 'not slow')",
    "multiprocess: spawns processes (gloo ranks, CLI or pytest subprocesses, Triton interpreter groups); also slow",
)


def pytest_configure(config) -> None:
    """gemzoo's test tiers as markers, so that a plugin's own run (``--strict-markers``) knows them too."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)
