"""The one base class for mistakes in what the user asked for.

Anything raised as a `UserInputError` (bad config value, impossible mesh, missing
tokenizer or dataset, infeasible planner constraints, ...) is reported by the entry
points as a single `error: ...` line with exit code 2 — never a traceback.  Its message
must name the culprit and the fix.  Bugs keep raising ordinary exceptions.
"""


class UserInputError(ValueError):
    pass
