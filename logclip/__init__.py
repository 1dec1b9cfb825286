"""Log lines with client-supplied strings cut to a bounded length.

A client controls the request id, the model name, stop strings and the text of the errors that
quote them; logged verbatim, one request can write megabytes to the log (a 100 KB model name
was). `configure()` sets up the process's logging (both islands call it from their entry point)
with a filter that cuts every string argument of a log record to MAX_ARG_CHARS, saying how
long it was. Standard library only, like envflags, so both islands install it.
"""

from __future__ import annotations

import logging

__all__ = ["MAX_ARG_CHARS", "ClipFilter", "clip", "configure"]

#: The longest string argument a log line carries whole.
MAX_ARG_CHARS = 256

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def clip(value: object, limit: int = MAX_ARG_CHARS) -> object:
    """`value`, or a string cut to `limit` characters with its full length noted."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}...[{len(value)} characters]"
    return value


class ClipFilter(logging.Filter):
    """Cuts the string arguments of each record (`clip`); the format string stays whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(clip(a) for a in args)
        elif isinstance(args, dict):
            record.args = {k: clip(v) for k, v in args.items()}
        return True


def configure(level: str) -> None:
    """logging.basicConfig with FORMAT at `level`, and ClipFilter on the root handler."""
    logging.basicConfig(level=level, format=FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(ClipFilter())
