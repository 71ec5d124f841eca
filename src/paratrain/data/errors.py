"""The error every data command raises for input it cannot use."""


class DataError(ValueError):
    """Input that cannot be prepared or a dataset that cannot be read; says what to fix."""
