"""Every stub in ``exercises/chNN.py`` has the name and signature of its answer in ``solutions/chNN.py``.

The graded tests, the notebooks and ``kvlab.use_solution`` (which copies a solution over an
exercise) call both the same way, so the two files must offer the same public functions and
classes: the tasks, and the given pieces they import from ``kvlab.scaffold`` and re-export.
Signatures compare parameter names, kinds and defaults; a class compares its constructor and
its public methods.
"""
import inspect
import types

import pytest

from kvlab.grading import CHAPTERS, load_chapter


def _function(obj):
    """The Python function behind ``obj`` (a ``@triton.jit`` kernel's ``.fn``, compiled or
    interpreted), or None."""
    if inspect.isfunction(obj):
        return obj
    fn = getattr(obj, "fn", None)
    return fn if inspect.isfunction(fn) and not inspect.isclass(obj) else None


def _origin(obj) -> str:
    return getattr(_function(obj) or obj, "__module__", "") or ""


def interface(module) -> dict:
    """The public functions, kernels and classes ``module`` defines or takes from ``kvlab.scaffold``.

    Helpers it merely imports from elsewhere (``check_count``, ``BlockPool``, an error class)
    are not part of it: a solution may import what its exercise leaves to the learner.
    """
    names = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or not (_function(obj) or inspect.isclass(obj)):
            continue
        origin = _origin(obj)
        if origin == module.__name__ or origin.startswith("kvlab.scaffold"):
            names[name] = obj
    return names


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _describe(obj) -> dict[str, list[tuple]]:
    """``{"": signature}`` for a function or kernel; for a class, its constructor and public methods."""
    fn = _function(obj)
    if fn is not None:
        return {"": _params(fn)}
    described = {"": _params(obj)}
    for name, member in inspect.getmembers(obj):
        if name.startswith("_"):
            continue
        if isinstance(inspect.getattr_static(obj, name), property):
            described[f".{name}"] = [("property",)]
        elif _function(member) or inspect.ismethod(member):
            described[f".{name}"] = _params(member)
    return described


def interface_mismatches(exercise, solution) -> list[str]:
    """What differs between the two modules' interfaces, one line each (empty: they match)."""
    problems = []
    for here, there, mine in ((exercise, solution, interface(exercise)), (solution, exercise, interface(solution))):
        for name in sorted(mine):
            if not hasattr(there, name):
                problems.append(f"{name}: in {here.__name__}, missing from {there.__name__}")
    # e.g. solutions/ch02.py imports the course's write_kv_kernel where the exercise has a stub
    shared = sorted((set(interface(exercise)) | set(interface(solution))) & set(vars(exercise)) & set(vars(solution)))
    for name in shared:
        got, want = _describe(getattr(exercise, name)), _describe(getattr(solution, name))
        for member in sorted(set(got) | set(want)):
            if got.get(member) != want.get(member):
                problems.append(f"{name}{member}: {exercise.__name__} has {got.get(member)}, "
                                f"{solution.__name__} has {want.get(member)}")
    return problems


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_stubs_match_their_answers(chapter):
    exercise, solution = load_chapter(chapter, "exercises"), load_chapter(chapter, "solutions")
    assert interface(solution), f"solutions/{chapter}.py defines nothing"
    assert interface_mismatches(exercise, solution) == []


def _module(name, source):
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


ANSWER = '''
def task(a, b=1, *, scale=2.0):
    return a + b

class Pool:
    def __init__(self, n, size=16):
        self.n = n
    def take(self, k=1):
        return k
'''


@pytest.mark.parametrize("stub, problem", [
    (ANSWER, None),
    (ANSWER.replace("def task(a, b=1,", "def task(a, b=2,"), "task: "),                 # a default
    (ANSWER.replace("def task(a, b=1,", "def task(a, c=1,"), "task: "),                 # a name
    (ANSWER.replace("*, scale=2.0", "scale=2.0"), "task: "),                            # a kind
    (ANSWER.replace("def take(self, k=1)", "def take(self, k=1, j=0)"), "Pool.take: "),  # a method
    (ANSWER.replace("size=16", "size=8"), "Pool: "),                                     # a constructor
    (ANSWER.replace("def task(", "def renamed("), "task: in answer, missing from stub"),
])
def test_a_drifted_signature_is_caught(stub, problem):
    exercise, solution = _module("stub", stub), _module("answer", ANSWER)
    problems = interface_mismatches(exercise, solution)
    if problem is None:
        assert problems == []
    else:
        assert any(line.startswith(problem) for line in problems), problems


def test_given_code_is_shared_not_copied():
    """A given piece is the scaffold's code in both files: a fix reaches exercise and solution."""
    for chapter in sorted(CHAPTERS):
        exercise, solution = load_chapter(chapter, "exercises"), load_chapter(chapter, "solutions")
        for name, obj in interface(solution).items():
            if _origin(obj).startswith("kvlab.scaffold"):
                assert _origin(getattr(exercise, name)) == _origin(obj), f"{chapter}.{name}"


def test_kernels_are_compared_too():
    for chapter, kernel in (("ch02", "write_kv_kernel"), ("ch05", "online_softmax_update"),
                            ("ch06", "merge_splits_kernel"), ("ch09", "write_kv_quantized_kernel")):
        assert kernel in interface(load_chapter(chapter, "exercises")), f"{chapter}.{kernel}"
