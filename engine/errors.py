"""Exceptions raised by the engine core.

Each is precise about what went wrong and names the file or field at fault, so
the layers above can report it without a traceback from deep inside a library.
"""


class TrioserveError(Exception):
    """Base class of every error trioserve raises on purpose."""


class ModelLoadError(TrioserveError):
    """A model could not be loaded: a missing path, no or corrupt weights,
    a config that does not match the weights, or an unsupported architecture.

    The message names the file or config field at fault. No part of the model
    is left loaded when this is raised.
    """


class InvalidRequestError(TrioserveError, ValueError):
    """A request's parameters are invalid.

    ``field`` names the offending parameter (``"temperature"``, ``"prompt"``,
    ...) so the HTTP layer can fill OpenAI's ``param`` in its error JSON.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RequestTooLongError(InvalidRequestError):
    """A prompt does not fit the context (``max_model_len``) or the KV pool."""


class CpuCapabilityError(ModelLoadError):
    """This CPU (or this torch build) cannot run what was asked of it: a
    dtype whose matmul fails here, ``pack_weights=True`` where the packed
    path does not work, or an unknown ``TRIOSERVE_CPU_ASSUME``.

    The message names the dtype, path or setting and what the machine does
    support (see ``capability.CpuPaths``).
    """


class TokenizerError(InvalidRequestError):
    """The tokenizer failed on a request's prompt or messages (an exception
    from inside the tokenizer, not a rule the request broke knowingly).

    Only that request is refused; the message names the exception's class,
    never its text, which may quote the prompt.
    """

class GenerationConfigError(ModelLoadError, ValueError):
    """A generation config that cannot be read: a missing path, a file that
    is not a JSON object, a sampling field of the wrong type or range. The
    message names the path and the field."""
