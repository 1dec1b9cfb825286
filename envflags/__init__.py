"""Command-line flags with environment fallbacks, and the one true/false vocabulary.

Both islands read their settings through this package: the core (`TRELLIS_CORE_*`) and every
gateway (`TRELLIS_GATEWAY_*`, and the few variables of other servers a gateway honours, such as
DJL's `OPTION_TGI_COMPAT` or the WebSocket protocol's `MODEL_DEFAULT_DO_SAMPLE`). It is a
top-level package with nothing but the standard library, so it is installed by the `core` and
the `gateway` extras alike and importing it pulls in neither island.

Booleans (`parse_bool`): 1/true/yes/on and 0/false/no/off, in any case and with surrounding
blanks. An empty (or blank) value means "not set": the setting keeps its default, exactly as if
the variable were absent. A rendered template that leaves a value out (`TRELLIS_CORE_X=`) then
never flips a setting that is on by default. Any other word is an error naming the variable.

Lists (`comma_list` with `ListAction`, e.g. API keys): a repeatable flag whose every value may
hold several comma-separated items; its variable holds the same comma-separated list, and the
command line, when it gives the flag, replaces the variable's list.

The rules of settings both islands have live here too: API keys (envflags.apikeys) and the TLS
flags a server offers its clients (envflags.tls).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["FALSE_WORDS", "TRUE_WORDS", "EnvArgumentParser", "ListAction", "comma_list", "parse_bool"]

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(raw: str) -> bool | None:
    """A true/false environment value.

    Returns:
        True or False; None for an empty or blank value (not set: the default applies).

    Raises:
        ValueError: any other word.
    """
    value = raw.strip().lower()
    if not value:
        return None
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError("expected a boolean (1/0, true/false, yes/no, on/off)")


def comma_list(raw: str) -> list[str]:
    """`"a, b,,c"` -> `["a", "b", "c"]`: comma-separated items, blanks stripped, empty ones dropped."""
    return [item.strip() for item in raw.split(",") if item.strip()]


class ListAction(argparse.Action):
    """A repeatable option (`type=comma_list`) whose values accumulate into one list; the first
    value on the command line replaces the default (the environment's list)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = list(values) if isinstance(values, list) else [values]
        setattr(namespace, self.dest, items if current is self.default or current is None else [*current, *items])


class EnvArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose options fall back to environment variables.

    Option `--some-flag` (dest `some_flag`) falls back to `<env_prefix>SOME_FLAG`, then to the
    variables given as `env_aliases=(...)` to `add_argument`, in that order; the command line
    wins over all of them. Boolean options are declared with `argparse.BooleanOptionalAction`
    and read with `parse_bool`. A malformed environment value is a usage error (exit status 2)
    naming the variable. The help of each option names its variables.

    Args:
        env_prefix: e.g. "TRELLIS_CORE_".
        environ: the environment to read (os.environ in a process, a dict in tests).
    """

    def __init__(self, *args: Any, env_prefix: str, environ: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix
        self.environ = environ
        self._aliases: dict[str, tuple[str, ...]] = {}

    def add_argument(self, *args: Any, env_aliases: Iterable[str] = (), **kwargs: Any) -> argparse.Action:
        """argparse's add_argument, plus `env_aliases`: more variables read after the prefixed one."""
        action = super().add_argument(*args, **kwargs)
        if env_aliases:
            self._aliases[action.dest] = tuple(env_aliases)
        return action

    def env_names(self, dest: str) -> tuple[str, ...]:
        """The environment variables that back option `dest`, the one read first first."""
        return (self.env_prefix + dest.upper(), *self._aliases.get(dest, ()))

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """Parse `args` with the environment fallbacks applied as defaults.

        Raises:
            SystemExit: a usage error (argparse prints the message).
        """
        for action in self._actions:
            if not action.option_strings or action.dest == "help":
                continue
            names = self.env_names(action.dest)
            if action.help and names[0] not in action.help:
                action.help = f"{action.help} [env {', '.join(names)}]"
            for name in names:
                if name not in self.environ:
                    continue
                raw = self.environ[name]
                try:
                    value = _convert(action, raw)
                except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                    self.error(f"environment variable {name}={raw!r}: {e}")
                if value is None:
                    continue  # an empty boolean: not set
                action.default = value
                action.required = False
                break
        return super().parse_args(args, namespace)


def _convert(action: argparse.Action, raw: str) -> object:
    """An environment value as the option's value (None: an empty boolean, not set)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return parse_bool(raw)
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value
