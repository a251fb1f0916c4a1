from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import pq as pq
from ._errors import (
    ArgumentError as ArgumentError,
    ChunkError as ChunkError,
    EncodeError as EncodeError,
    HeaderError as HeaderError,
    InternalError as InternalError,
    KvcError as KvcError,
    OutOfRangeError as OutOfRangeError,
    OutputError as OutputError,
    ProfileError as ProfileError,
    ProfileMismatchError as ProfileMismatchError,
)
from ._native import Profile as Profile

__version__: str
DEFAULT_LEVEL: int
DEFAULT_CHUNK_TOKENS: int

# Per-layer [T, H, D] arrays or one stacked [L, T, H, D] array: numpy float16, float32, uint16
# (bfloat16 bits), torch CPU tensors or other __dlpack__ objects.
KvInput = Union[Any, Sequence[Any]]
BytesLike = Union[bytes, bytearray, memoryview]

class Sample(NamedTuple):
    keys: KvInput
    values: KvInput
    queries: Optional[KvInput] = None
    q_start: int = 0

def encode(
    keys: KvInput,
    values: KvInput,
    *,
    level: int = 7,
    levels: Optional[Sequence[int]] = None,
    profile: Optional[Profile] = None,
    embed_profile: bool = False,
    chunk_tokens: int = 1536,
    group: int = 10,
    sink: int = 1,
    uniform_steps: bool = False,
    queries: Optional[KvInput] = None,
    q_start: int = 0,
    model_id: str = "",
    rope_style: str = "none",
    rope_theta: float = 10000.0,
    rope_scaling: float = 1.0,
    k_pre_rope: bool = False,
    first_position: int = 0,
) -> bytes: ...

class Stream:
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    dtype: str
    chunk_tokens: int
    group: int
    n_sink: int
    levels: int
    first_position: int
    model_id: str
    rope: Tuple[str, float, float, bool]
    profile_hash: bytes
    profile_embedded: bool
    chunks: List[Tuple[int, int, int, int]]
    nbytes: int
    def __init__(self, data: BytesLike, profile: Optional[Profile] = None) -> None: ...
    def token_range(self, chunk: int) -> Tuple[int, int]: ...
    def decode(
        self,
        *,
        tokens: Optional[Union[Tuple[int, int], range]] = None,
        chunk: Optional[int] = None,
        out: Optional[Tuple[KvInput, KvInput]] = None,
        dtype: Optional[Union[str, np.dtype]] = None,
    ) -> Tuple[Any, Any]: ...

def decode(
    data: BytesLike,
    *,
    profile: Optional[Profile] = None,
    out: Optional[Tuple[KvInput, KvInput]] = None,
    dtype: Optional[Union[str, np.dtype]] = None,
    tokens: Optional[Union[Tuple[int, int], range]] = None,
) -> Tuple[Any, Any]: ...
