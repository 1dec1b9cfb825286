"""Field tables: one per schema, used both ways.

A schema's table is a tuple of rows `Field(name, path, transform)`: the client's field, the
GenerateRequest field path it sets, and how its value becomes the contract's value. The same
table drives the request translation (`FieldTable.apply`) and names the client's field when the
core refuses a value: the core's google.rpc BadRequest names the GenerateRequest path
("sampling.top_p"), and `client_error` turns that into the client's name ("parameters.top_p" for
LMI, "top_p" for OpenAI and Triton, "generation_config.top_p" for WebSocket), through the names
`FieldTable.names` gives for the fields the client actually sent.

Rules across fields (one contract field fed by two client fields, a value that sets two
contract fields) stay in the schema's translate module; their rows (`by_rule`) have no
transform, so they only name the field in errors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from gateways.common.status import GatewayError

#: value -> the contract's value; None leaves the contract field unset.
Transform = Callable[[Any], Any]


def same(value: Any) -> Any:
    """The identity transform: the client's value is the contract's."""
    return value


def true_or_unset(value: Any) -> bool | None:
    """True for a true value, else unset (flags whose false is the contract's default)."""
    return True if value else None


@dataclass(frozen=True, slots=True)
class Field:
    """One row of a schema's field table.

    Attributes:
        name: the client's field as error messages name it ("parameters.top_p", "max_tokens").
            The value is read from the request under its last segment ("top_p").
        path: the GenerateRequest field path it sets ("sampling.top_p"); None: accepted without
            an effect on the core request.
        transform: the client's value (never None) -> the contract's value (None: leave unset;
            a list extends a repeated field, a mapping updates a map field); None: set by the
            schema's translation itself (a rule across fields), the row only names the field.
        aliases: other names the client may use for it (error messages use the one it used).
    """

    name: str
    path: str | None
    transform: Transform | None = same
    aliases: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """Where the value is read from: the last segment of `name`."""
        return self.name.rsplit(".", 1)[-1]

    def spelled(self, used: str) -> str:
        """`name` as the client spelled it (an alias replaces the last segment)."""
        return self.name if used == self.key else self.name[: len(self.name) - len(self.key)] + used


def same_names(prefix: str, group: str, names: Iterable[str]) -> tuple[Field, ...]:
    """Rows for client fields named as the contract's: `prefix + name` sets `group.name`
    ("parameters.top_p" -> "sampling.top_p"), the value as given."""
    return tuple(Field(prefix + name, f"{group}.{name}") for name in names)


def by_rule(name: str, *paths: str) -> tuple[Field, ...]:
    """Rows for a client field whose contract fields the schema's translation sets itself (a
    rule across fields): they only name `paths` in errors."""
    return tuple(Field(name, path, None) for path in paths)


class FieldTable:
    """A schema's rows, in order (see the module docstring).

    Several rows may set the same path: `apply` lets the later given one win, and `names` names
    it; when the client gave none of them, the first row names the path.
    """

    def __init__(self, rows: Iterable[Field]) -> None:
        self.rows = tuple(rows)
        self._first: dict[str, str] = {}
        for row in self.rows:
            if row.path is not None:
                self._first.setdefault(row.path, row.name)
        # Every request runs `apply`: its rows' keys and split paths are worked out once here.
        self._settable = tuple(
            (row.key, row.transform, *_split(row.path))
            for row in self.rows
            if row.path is not None and row.transform is not None
        )

    def apply(self, values: Mapping[str, Any], target: Message) -> None:
        """Set the contract fields of `target` (a GenerateRequest) from the client's `values` (by
        row key, e.g. a parsed model's `vars()`; None or absent: not given, so the core's engine
        default applies)."""
        for key, transform, groups, leaf in self._settable:
            value = values.get(key)
            if value is None:
                continue
            converted = transform(value)
            if converted is not None:
                _set(target, groups, leaf, converted)

    def names(self, given: Collection[str] = ()) -> dict[str, str]:
        """Contract path -> the client's name for it, for the fields in `given` (keys or aliases
        as the client spelled them); paths the client did not set get their first row's name."""
        out = dict(self._first)
        for row in self.rows:
            if row.path is None:
                continue
            used = next((k for k in (row.key, *row.aliases) if k in given), None)
            if used is not None:
                out[row.path] = row.spelled(used)
        return out


def _split(path: str) -> tuple[tuple[str, ...], str]:
    """`"sampling.top_p"` -> `(("sampling",), "top_p")`."""
    *groups, leaf = path.split(".")
    return tuple(groups), leaf


def _set(target: Message, groups: tuple[str, ...], leaf: str, value: Any) -> None:
    """Set `leaf` of the message at `groups` under `target`: a list extends a repeated field, a
    mapping updates a map field (an empty one changes nothing, not even the presence of the
    enclosing message), anything else is assigned."""
    if isinstance(value, list | tuple | Mapping) and not value:
        return
    for group in groups:
        target = getattr(target, group)
    if isinstance(value, list | tuple):
        getattr(target, leaf).extend(value)
    elif isinstance(value, Mapping):
        getattr(target, leaf).update(value)
    else:
        setattr(target, leaf, value)


def client_error(err: GatewayError, names: Mapping[str, str], *, prefix: bool = True) -> GatewayError:
    """`err` in the client's terms: its `param`, when it is a contract path in `names`, becomes
    the client's field name, and (with `prefix`) the message is led by that name
    ("parameters.top_p: top_p must be in (0, 1], got 0.") unless it already starts with it.
    Errors that name no contract field (the gateway's own, which use the client's names
    already) are returned as they are."""
    if err.param is None or err.param not in names:
        return err
    name = names[err.param]
    message = err.message
    if prefix and not _leads_with(message, name):
        message = f"{name}: {message}"
    return GatewayError(err.code, message, param=name, reason=err.reason)


def _leads_with(message: str, name: str) -> bool:
    """Whether `message` starts with the field name `name` (not with a longer name)."""
    if not message.startswith(name):
        return False
    after = message[len(name) : len(name) + 1]
    return not (after.isalnum() or after in ("_", ".", "["))
