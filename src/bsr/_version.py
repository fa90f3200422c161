"""bsr's version: the installed distribution's, from its metadata (pyproject.toml's ``version``).

One source: the version is written once, in pyproject.toml, and an install (wheel or editable)
records it in the distribution's metadata, which this reads. A source tree put on ``sys.path``
without installing has no metadata; it then says :data:`UNKNOWN` rather than a number that may
be wrong.
"""

from __future__ import annotations

#: the distribution the package ``bsr`` is installed as (``pip install bsr-kv``; the name ``bsr``
#: on PyPI is an unrelated project)
DISTRIBUTION = "bsr-kv"
#: the version of a bsr that was never installed (a PEP 440 local version: sorts below 0.0.1)
UNKNOWN = "0+unknown"


def installed_version(distribution: str = DISTRIBUTION) -> str:
    """``distribution``'s version from its installed metadata, or :data:`UNKNOWN`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return UNKNOWN
