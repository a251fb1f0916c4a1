"""The exceptions of :mod:`kvc`: one class per error kind of the library (the C ABI's status
codes), all subclasses of :class:`KvcError`.

Each carries the library's message, ``check`` (the spec check that rejected the input, such
as ``"H5"`` for a header CRC, or ``None``) and ``spec_class`` (the spec's error class, such as
``"HeaderCrc"``).
"""


class KvcError(Exception):
    """Base class of every error raised by kvc."""

    code = 0
    check = None
    spec_class = None


class ArgumentError(KvcError, ValueError):
    """An argument is invalid: wrong dtype, shape, layout, overlapping or read-only outputs."""

    code = 1


class HeaderError(KvcError):
    """The stream's header or chunk index is invalid (spec checks H1-H32): not a kvc stream,
    truncated, a bad CRC, counts over the limits."""

    code = 2


class ProfileError(KvcError):
    """A profile's bytes are invalid (spec checks P1-P23), embedded or given."""

    code = 3


class ProfileMismatchError(KvcError):
    """The profile does not fit the stream (O1-O4): required but not given, another hash,
    another shape, a level it lacks."""

    code = 4


class ChunkError(KvcError):
    """A chunk is corrupt (spec checks C1-C2, B1-B10)."""

    code = 5


class OutputError(KvcError, ValueError):
    """The output arrays do not match the stream (count or size)."""

    code = 6


class OutOfRangeError(KvcError, IndexError):
    """A chunk or token range outside the stream was requested."""

    code = 7


class EncodeError(KvcError, ValueError):
    """The cache or the parameters cannot be encoded (or a profile learned from them)."""

    code = 8


class InternalError(KvcError):
    """A bug in kvc (please report it)."""

    code = 9


ALL = (
    ArgumentError,
    HeaderError,
    ProfileError,
    ProfileMismatchError,
    ChunkError,
    OutputError,
    OutOfRangeError,
    EncodeError,
    InternalError,
)
