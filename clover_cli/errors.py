"""Errors the user can act on. The CLI prints them as one line on stderr and exits with code 2."""


class CloverError(Exception):
    """A problem with the user's input or environment, explained in one line."""
