"""Errors the engine raises for bad input: values with messages a user can act on."""


class InvalidRequestError(ValueError):
    """The request can never be served as asked (too long, bad parameters). Other requests are unaffected.

    `param` names the offending field so the server can fill OpenAI's error object.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(RuntimeError):
    """The model path is missing, unreadable or of an architecture we do not implement."""
