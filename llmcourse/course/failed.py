"""`CheckFailed`: what a check raises when the learner's function is wrong."""


class CheckFailed(AssertionError):
    """A learner's function gave a wrong answer (the message says which and why).

    In Jupyter the message is shown instead of a traceback: the frames would be the check's own
    code, not the learner's. nbgrader's feedback still gets the exception's name and value.
    """

    def _render_traceback_(self) -> list[str]:
        return str(self).splitlines() or [type(self).__name__]
