"""Griffe extension for the API reference (mkdocs.yml): what static analysis of bsr's source
cannot see on its own.

- Sphinx roles. bsr's docstrings cross-reference names with Sphinx roles
  (``:class:`~bsr.Tier```, ``:func:`admit```), which Markdown would print literally. Each role
  becomes a link to the object's entry where the reference renders one (an optional autoref:
  mkdocs-autorefs leaves plain code where the object has no entry, such as a private module);
  ``~`` keeps only the last dotted part as the title, as in Sphinx. A bare name
  (``:class:`LayerPlan```) is looked up in the docstring's own module first.
- Option fields. An options dataclass declares its fields with ``bsr.option(parse[, default])``,
  a ``dataclasses.field``: the constructor's default is ``default``, and a field without one is
  required (griffe would show the ``option(...)`` call as the default).
- ``@takes_options(XOptions)``. A tier's ``__init__(self, options)`` decorated so takes the
  options class's fields as its own parameters (``inspect.signature`` says so at run time): the
  reference shows those parameters, which the tier's docstring documents.
- Noise. An instance attribute's value is the expression ``__init__`` assigned (``name =
  text(name, 'tier name')``): left out, its annotation and docstring stay. A reST literal block's
  ``Example::`` prints as ``Example:`` (the indented block after it is code in Markdown too).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import griffe

LITERAL = re.compile(r"(?<=\S)::\n\n")
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`<>]+)`")


def _target(obj: griffe.Object, name: str) -> str:
    """The dotted path ``name`` means inside ``obj``'s module (itself when already dotted)."""
    local = name.lstrip(".")
    if "." in local:
        return local
    members = obj.module.members
    return members[local].path if local in members else local


def linked(obj: griffe.Object, text: str) -> str:
    """``text`` with each Sphinx role replaced by an optional autoref to its target."""

    def one(match: re.Match[str]) -> str:
        short, name = match.group(1), match.group(2).strip()
        title = name.rsplit(".", 1)[-1] if short else name.lstrip(".")
        path = _target(obj, name)
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'

    return LITERAL.sub(":\n\n", ROLE.sub(one, text))


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined inside it (aliases, imported names, left out)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)  # type: ignore[arg-type]


def _option_default(default: Any) -> tuple[bool, Any]:
    """(whether it is an ``option(...)`` call, the field's real default or None if required)."""
    if not isinstance(default, griffe.ExprCall) or str(default.function) not in (
        "option",
        "bsr.option",
    ):
        return False, None
    args = [a for a in default.arguments if not isinstance(a, griffe.ExprKeyword)]
    keywords = {a.name: a.value for a in default.arguments if isinstance(a, griffe.ExprKeyword)}
    return True, keywords.get("default", args[1] if len(args) > 1 else None)


def _fix_option_defaults(cls: griffe.Class) -> None:
    init = cls.members.get("__init__")
    if init is None or init.is_alias or not isinstance(init, griffe.Function):
        return
    for param in init.parameters:
        is_option, default = _option_default(param.default)
        if is_option:
            param.default = default
    for attr in cls.members.values():
        if not attr.is_alias and isinstance(attr, griffe.Attribute):
            is_option, default = _option_default(attr.value)
            if is_option:
                attr.value = default


def _options_class(init: griffe.Function) -> griffe.Class | None:
    """The options class of a ``@takes_options(X)`` decorated ``__init__``, if any."""
    for decorator in init.decorators:
        call = decorator.value
        if isinstance(call, griffe.ExprCall) and str(call.function).endswith("takes_options"):
            target = call.arguments[0]
            try:
                found = init.parent.resolve(str(target)) if init.parent else None  # type: ignore[union-attr]
                options = init.modules_collection[found] if found else None
            except (griffe.NameResolutionError, KeyError):
                return None
            options = options.final_target if options is not None and options.is_alias else options
            return options if isinstance(options, griffe.Class) else None
    return None


class BsrDocs(griffe.Extension):
    """What the module docstring says, done once the whole package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        # griffe's own dataclass support runs after every other extension: run it first (it
        # makes each dataclass's __init__ once, so running it again later changes nothing)
        griffe.DataclassesExtension().on_package(pkg=pkg)
        objects = list(_objects(pkg))
        for obj in objects:
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = linked(obj, obj.docstring.value)
            kinds = obj.labels & {"instance-attribute", "class-attribute"}
            if isinstance(obj, griffe.Attribute) and kinds == {"instance-attribute"}:
                obj.value = None
            if isinstance(obj, griffe.Class):
                _fix_option_defaults(obj)
        for obj in objects:
            init = obj.members.get("__init__") if isinstance(obj, griffe.Class) else None
            if isinstance(init, griffe.Function):
                options = _options_class(init)
                if options is not None and "__init__" in options.all_members:
                    fields = options.all_members["__init__"].parameters  # type: ignore[union-attr]
                    init.parameters = griffe.Parameters(*list(fields))
