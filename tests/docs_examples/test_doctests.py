"""Every example in the package's docstrings runs as written.

Each docstring runs on its own, with empty globals (not the module's): an example
must import what it uses, as a reader copying it would have to.
"""

import doctest
import importlib
import pkgutil

import pytest

import tf_checkpointing

MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(tf_checkpointing.__path__,
                                                               "tf_checkpointing."))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples(module_name):
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, module_name, globs={})
    return [t for t in tests if t.examples]


@pytest.mark.parametrize("module_name", ["tf_checkpointing"] + MODULES)
def test_docstring_examples_run(module_name):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in _examples(module_name):
        runner.run(test)
    failed, attempted = runner.summarize(verbose=False)
    assert failed == 0, f"{failed} of {attempted} docstring examples failed in {module_name}"


# Results handed out by a function whose docstring shows them in its example.
RESULT_TYPES = {"MemoryStats": "measure", "Segment": "plan_sequential",
                "SequentialPlan": "plan_sequential"}


def test_the_public_api_has_examples():
    """Each public function, class and module (top level, `plans` and `debug`) documents
    a runnable example."""
    from tf_checkpointing import debug, plans

    missing = [f"{module.__name__}.{name}"
               for module in (tf_checkpointing, plans, debug) for name in module.__all__
               if ">>>" not in (getattr(module, RESULT_TYPES.get(name, name)).__doc__ or "")]
    assert not missing, f"no docstring example: {missing}"
