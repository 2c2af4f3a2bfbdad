"""Errors the user can act on. The CLI prints them as one line on stderr and exits with their code (2 unless said)."""


class CloverError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
