"""Generate docs/api.md from the docstrings of roundpipe's public API.

    python docs/gen_api.py          # rewrite docs/api.md
    python docs/gen_api.py --check  # exit 1 if docs/api.md is out of date (tests/test_docs.py)

The public API is what ``roundpipe/__init__.py`` exports (``roundpipe.__all__``), grouped by the
module that defines each name, plus the public functions and classes of the exported submodules
(``roundpipe.optim_thread``, ``roundpipe.optim``). For a class, the entries are its constructor
and the public methods and properties the class itself defines (methods inherited from torch
are torch's and documented there).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
import types
from pathlib import Path

API_PATH = Path(__file__).resolve().parent / "api.md"

HEADER = """\
# API reference

Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand
(`tests/test_docs.py` fails when this page and the docstrings disagree).
Each docstring says which thread may call it and whether it blocks; see
[threads-and-staleness.md](threads-and-staleness.md) for the threads.
"""


def _doc(obj) -> str:
    doc = inspect.getdoc(obj)
    return doc.strip() if doc else "(no docstring)"


class _Raw:
    """An annotation kept as the source text (modules use ``from __future__ import annotations``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _raw(annotation):
    return _Raw(annotation) if isinstance(annotation, str) else annotation


def _signature(obj, drop_self: bool = False) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name == "self":
        params = params[1:]
    params = [p.replace(annotation=_raw(p.annotation)) for p in params]
    returns = sig.return_annotation
    if inspect.isclass(obj) or returns in ("None", None):
        returns = inspect.Signature.empty
    return str(sig.replace(parameters=params, return_annotation=_raw(returns)))


def _method_entries(cls) -> list[tuple[str, object]]:
    entries = []
    for name, member in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        wrapped = getattr(member, "__wrapped__", None)
        if getattr(member, "hooked", False) and any(
            base.__dict__.get(name) is wrapped for base in cls.__mro__[1:]
        ):
            continue  # torch.optim's profiling wrapper of an inherited step(), put here at runtime
        if isinstance(member, property) or inspect.isfunction(member):
            entries.append((name, member))
    return entries


def _render_class(qualname: str, cls, out: list[str]) -> None:
    if issubclass(cls, enum.Enum):
        out.append(f"### `{qualname}`\n")
        out.append("Enum: " + ", ".join(f"`{m.name}`" for m in cls) + "\n")
        out.append(_doc(cls) + "\n")
        return
    if issubclass(cls, BaseException):
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        out.append(f"### `{qualname}({bases})`\n")
        out.append(_doc(cls) + "\n")
        return
    out.append(f"### `{qualname}{_signature(cls)}`\n")
    out.append(_doc(cls) + "\n")
    if dataclasses.is_dataclass(cls):
        return  # the signature lists the fields, the docstring explains them
    for name, member in _method_entries(cls):
        if isinstance(member, property):
            out.append(f"#### `{qualname}.{name}` (property)\n")
        else:
            out.append(f"#### `{qualname}.{name}{_signature(member, drop_self=True)}`\n")
        out.append(_doc(member) + "\n")


def _render_object(qualname: str, obj, out: list[str]) -> None:
    if inspect.isclass(obj):
        _render_class(qualname, obj, out)
    elif callable(obj):
        out.append(f"### `{qualname}{_signature(obj)}`\n")
        out.append(_doc(obj) + "\n")


def _public_names(module: types.ModuleType) -> list[str]:
    return list(getattr(module, "__all__", []))


def render() -> str:
    import roundpipe

    out = [HEADER]
    # Top-level names, grouped by their defining module, in the order of roundpipe.__all__.
    groups: dict[str, list[str]] = {}
    submodules = []
    for name in _public_names(roundpipe):
        obj = getattr(roundpipe, name)
        if isinstance(obj, types.ModuleType):
            submodules.append(obj)
        elif inspect.isclass(obj) or callable(obj):
            groups.setdefault(obj.__module__, []).append(name)
    out.append(f"## `roundpipe` {roundpipe.__version__}\n")
    out.append(_doc(roundpipe) + "\n")
    for module_name, names in groups.items():
        module = sys.modules[module_name]
        out.append(f"## `{module_name}`\n")
        out.append(_doc(module) + "\n")
        for name in names:
            _render_object(f"roundpipe.{name}", getattr(roundpipe, name), out)
    for module in submodules:
        out.append(f"## `{module.__name__}`\n")
        out.append(_doc(module) + "\n")
        for name in _public_names(module):
            _render_object(f"{module.__name__}.{name}", getattr(module, name), out)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _generate import main

    raise SystemExit(main(API_PATH, render, "Generate docs/api.md from the docstrings."))
