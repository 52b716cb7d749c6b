"""The given (not graded) code of the exercises, written once.

``exercises/chNN.py`` (your code) and ``solutions/chNN.py`` (the answers) both import their
chapter's module from here, so the code around the tasks is the same for both, and
``kvlab.use_solution`` (which copies a solution over an exercise) keeps working. A given piece
that runs a task (a kernel that calls your loop body, a pool that calls your ``fork``) is made
by a function that takes the task's implementation: ``write_kv = write_kv_with(write_kv_kernel)``;
chapter 5's given kernel takes your ``@triton.jit`` loop body as a ``tl.constexpr`` argument.
Chapter 1 has no given code.
"""


def is_written(probe) -> bool:
    """False while ``probe()`` runs into a stub's ``NotImplementedError`` (Triton wraps the one
    a kernel stub raises in its own error). Any other error counts as written: the engine run
    that follows shows it. The chapters' ``use_my_...`` use it to serve the course's own piece
    in place of one you have not written yet."""
    try:
        probe()
    except Exception as err:  # noqa: BLE001
        return not (isinstance(err, NotImplementedError) or "NotImplementedError" in str(err))
    return True


def check_pieces(pieces, allowed) -> None:
    """Refuse ``pieces`` unless it is a collection of names among ``allowed`` (a chapter's ``PIECES``)."""
    if isinstance(pieces, str) or set(pieces) - set(allowed):
        raise ValueError(f"pieces must be a collection of names among {allowed}, got {pieces!r}")
