"""Loading a callable a user names on the command line as ``package.module:attribute`` (the
kit's ``--target``, the main command's ``--attention``), every failure one line.

The module is looked up as ``python -m`` would, from the current directory first.
"""

import importlib
import os
import sys
from collections.abc import Callable


class NamedCallableError(ValueError):
    """A ``package.module:attribute`` that names no callable: why, in one line."""


def one_line(error: BaseException) -> str:
    """``error`` as one line: its type and its message, whitespace runs made one space (a
    user's exception may span lines; a refusal is one)."""
    return " ".join(f"{type(error).__name__}: {error}".split())


def load_callable(name: str, what: str) -> Callable[..., object]:
    """The callable ``name`` (``package.module:attribute``) names; ``what`` says what it
    should be, for the messages (``"a factory of adapters"``)."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise NamedCallableError(f"{name!r} is not package.module:attribute")
    if module_name.startswith("."):
        raise NamedCallableError(
            f"{module_name!r} is a relative module name: name it from the top, "
            "package.module:attribute, as python -m would"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise NamedCallableError(f"cannot import {module_name!r}: {error}") from error
    except Exception as error:  # the module's own code failed (a SyntaxError, a raise)
        raise NamedCallableError(f"cannot import {module_name!r}: {one_line(error)}") from error
    found = getattr(module, attribute, None)
    if not callable(found):
        raise NamedCallableError(f"module {module_name!r} has no callable {attribute!r} ({what})")
    return found  # type: ignore[no-any-return]
