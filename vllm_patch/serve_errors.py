"""Refusals the plugin raises while validating a request reach a server's client.

The plugin refuses some requests in ``InputProcessor._validate_params`` with a
plain ``ValueError`` (the relaxed tier refuses a sampled request). Offline,
``LLM.generate`` raises it to the caller as is. In a server, ``AsyncLLM.generate``
lets only ``VLLMClientError`` through as a client error; any other exception is
replaced by an ``EngineGenerateError()`` with no message, which the OpenAI layer
answers as HTTP 500 ``InternalServerError`` with an empty message.

:func:`install` wraps ``InputProcessor._validate_params`` once more: a plain
``ValueError`` raised by the plugin's own code there is re-raised as
:class:`PluginRequestError`, a ``VLLMValidationError`` (so the server answers
HTTP 400 ``BadRequestError`` with the message) that is still a ``ValueError``
(so offline callers catch it as before). vLLM's own errors pass through
unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path

from vllm.exceptions import VLLMError, VLLMValidationError

_PACKAGE_DIR = Path(__file__).resolve().parent
_WRAPPED_MARK = "_twin_spec_serve_errors"


class PluginRequestError(VLLMValidationError, ValueError):
    """A request the plugin refuses: a client error (400) with the plugin's message."""


def _raised_by_plugin(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is in this package."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        return Path(tb.tb_frame.f_code.co_filename).resolve().parent == _PACKAGE_DIR
    except OSError:
        return False


def install() -> None:
    """Wrap the current ``InputProcessor._validate_params`` (idempotent)."""
    from vllm.v1.engine import input_processor as ip

    current = ip.InputProcessor._validate_params
    if getattr(current, _WRAPPED_MARK, False):
        return

    @functools.wraps(current)
    def _validate_params(self, params, supported_tasks):
        try:
            return current(self, params, supported_tasks)
        except ValueError as exc:
            if isinstance(exc, VLLMError) or not _raised_by_plugin(exc):
                raise
            raise PluginRequestError(str(exc)) from exc

    setattr(_validate_params, _WRAPPED_MARK, True)
    ip.InputProcessor._validate_params = _validate_params
