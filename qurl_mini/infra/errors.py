"""The one base class of the errors that end a run with one line (exit 2): each entry script catches it once."""


class OneLineError(Exception):
    """A problem the user can fix (a flag, a file, the machine); its message is one line naming it."""
