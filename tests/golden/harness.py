"""The golden harness every schema's golden tests use (and the core contract's): one placeholder
dialect, one matcher, one regenerate flag.

A golden case is a JSON file under tests/golden/<schema>/. Its expected values are JSON where
values random by nature are placeholders (one dialect for every schema):

- `"<any>"`: anything; `"<str>"`, `"<bool>"`, `"<int>"`, `"<number>"` (int or float, not a
  boolean): that JSON type;
- `"<token_id>"`: an integer >= 0; `"<logprob>"`: a number <= 0;
- `"<one_of:a|b|c>"`: one of those strings (`null` stands for JSON null);
- `["<each>", T]`: an array whose items all match T; `["<each:N>", T]`: exactly N of them;
- an object key ending in `?`: the key may be absent.

Everything else must be equal and of the same JSON type (1 is not 1.0 is not true), objects
have exactly the expected keys in the expected order, arrays the expected length.

Regenerate: `TRELLIS_UPDATE_GOLDEN=1 pytest tests/golden` rewrites the expected values of every
case from what the code produces now (`check`): where the old expected value still matches it
is kept (placeholders survive), elsewhere the new value is written. Review the diff against the
seed before committing it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parent
UPDATE = os.environ.get("TRELLIS_UPDATE_GOLDEN") == "1"

_SIMPLE = {
    "<any>": lambda v: True,
    "<str>": lambda v: isinstance(v, str),
    "<bool>": lambda v: isinstance(v, bool),
    "<int>": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "<number>": lambda v: _is_number(v),
    "<token_id>": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "<logprob>": lambda v: _is_number(v) and v <= 0,
}


def cases(schema: str) -> list[Path]:
    """The golden files of one schema (tests/golden/<schema>/*.json), by name."""
    return sorted((GOLDEN / schema).glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    """One golden case."""
    return json.loads(path.read_text())


def match(expected: Any, actual: Any, path: str = "$") -> None:
    """Assert that `actual` matches the golden `expected` (module docstring); the message names
    the first place that differs, as a JSON path."""
    if _is_placeholder(expected):
        _match_placeholder(expected, actual, path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected an object, got {actual!r}"
        keys = [k.removesuffix("?") for k in expected if not k.endswith("?") or k[:-1] in actual]
        assert list(actual) == keys, f"{path}: expected the keys {keys}, got {list(actual)}"
        for key, value in expected.items():
            if key.removesuffix("?") in actual:
                match(value, actual[key.removesuffix("?")], f"{path}.{key.removesuffix('?')}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), f"{path}: expected an array, got {actual!r}"
        if expected and isinstance(expected[0], str) and expected[0].startswith("<each"):
            count = expected[0][len("<each") : -1].lstrip(":")
            if count:
                assert len(actual) == int(count), f"{path}: expected {count} items, got {len(actual)}"
            for i, item in enumerate(actual):
                match(expected[1], item, f"{path}[{i}]")
        else:
            assert len(actual) == len(expected), f"{path}: expected {len(expected)} items, got {len(actual)}"
            for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
                match(e, a, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{path}: expected {expected!r}, got {actual!r}"


def matches(expected: Any, actual: Any) -> bool:
    """Whether `actual` matches `expected` (no assertion)."""
    try:
        match(expected, actual)
    except AssertionError:
        return False
    return True


def regenerate(expected: Any, actual: Any) -> Any:
    """The new expected value: `expected` where it still matches, else `actual`, recursively for
    objects and for arrays of the same length."""
    if matches(expected, actual):
        return expected
    if isinstance(expected, dict) and isinstance(actual, dict):
        old = {k.removesuffix("?"): (k, v) for k, v in expected.items()}
        out = {}
        for key, value in actual.items():
            name, was = old.get(key, (key, value))
            out[name] = regenerate(was, value)
        return out
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [regenerate(e, a) for e, a in zip(expected, actual, strict=True)]
    return actual


def check(path: Path, case: dict[str, Any], got: dict[str, Any]) -> None:
    """Match each key of `got` against the case's expected value under the same key; with
    TRELLIS_UPDATE_GOLDEN=1, rewrite those values in the file first (`regenerate`)."""
    if UPDATE:
        for key, value in got.items():
            case[key] = regenerate(case.get(key), value)
        path.write_text(json.dumps(case, indent=2, ensure_ascii=False) + "\n")
    for key, value in got.items():
        match(case[key], value, f"{path.stem}:{key}")


def shape_of(example: Any) -> Any:
    """A concrete example as placeholders for values random by nature, so that another answer
    of the same shape matches it: strings -> `<str>`, integers >= 0 -> `<token_id>`, numbers
    <= 0 -> `<logprob>`, other numbers -> `<number>`, arrays -> `["<each>", shape of the first
    item]`. Booleans and null stay as they are (they are rules, not chance)."""
    if isinstance(example, dict):
        return {key: shape_of(value) for key, value in example.items()}
    if isinstance(example, list):
        return ["<each>", shape_of(example[0])] if example else []
    if isinstance(example, str):
        return "<str>"
    if isinstance(example, bool) or example is None:
        return example
    if isinstance(example, int) and example >= 0:
        return "<token_id>"
    return "<logprob>" if example <= 0 else "<number>"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_placeholder(value: Any) -> bool:
    """A placeholder of the dialect; any other string (a token text such as "<|eos|>") is a value."""
    return isinstance(value, str) and (value in _SIMPLE or (value.startswith("<one_of:") and value.endswith(">")))


def _match_placeholder(placeholder: str, actual: Any, path: str) -> None:
    if placeholder.startswith("<one_of:"):
        allowed = placeholder[len("<one_of:") : -1].split("|")
        ok = (actual is None and "null" in allowed) or (isinstance(actual, str) and actual in allowed)
    else:
        ok = _SIMPLE[placeholder](actual)
    assert ok, f"{path}: {actual!r} does not match {placeholder}"
