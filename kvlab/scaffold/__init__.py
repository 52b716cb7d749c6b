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


def same_outputs(got, want) -> bool:
    """Whether the ``RequestOutput`` lists ``got`` (an engine on your pieces) and ``want`` (the
    course's engine) hold the same tokens, every sample of every request. Prints what differs:
    each distinct error of a failed request (a piece that raised inside the engine fails its
    step), and the first token that differs."""
    same, errors = len(got) == len(want), []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.error:
            if g.error not in errors:
                errors.append(g.error)
                print(f"request {i} failed: {g.error}")
            same = False
            continue
        for mine, theirs in zip(g.outputs, w.outputs):
            a, b = mine.token_ids, theirs.token_ids
            if a != b:
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                where = f"token {k}: {a[k] if k < len(a) else 'none'} where the course's engine has " \
                        f"{b[k] if k < len(b) else 'none'}"
                print(f"request {i}, sample {mine.index} differs first at {where}")
                same = False
                break
    return same
