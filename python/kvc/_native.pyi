# Type stubs of the native module (python/src/lib.rs). Callers use the `kvc` package's
# functions, which pass contiguous numpy arrays here.
from typing import Any, List, Optional, Sequence, Tuple, Union

class Profile:
    @staticmethod
    def load(data: bytes) -> Profile: ...
    @staticmethod
    def learn(
        samples: Sequence[Any],
        *,
        rope_style: str = "none",
        rope_theta: float = 10000.0,
        rope_scaling: float = 1.0,
        k_pre_rope: bool = False,
        first_position: int = 0,
    ) -> Profile: ...
    def save(self) -> bytes: ...
    def hash(self) -> bytes: ...
    def hash_hex(self) -> str: ...
    @property
    def levels(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class _Stream:
    def __init__(self, data: bytes, profile: Optional[Profile] = None) -> None: ...
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
    def decode_into(self, start: int, end: int, k: Union[List[Any], Any], v: Union[List[Any], Any]) -> None: ...

class Codebook:
    @staticmethod
    def train(
        keys: Any, dim: int, method: str = "rq", m: int = 2, bits: int = 6,
        max_iters: Optional[int] = None, seed: int = 0,
    ) -> Codebook: ...
    def encode(self, keys: Any) -> bytes: ...
    def select(self, codes: Any, query: Any, k: int, n_init: int = 4, n_local: int = 64) -> List[int]: ...
    dim: int
    m: int
    bits: int

def encode(k: List[Any], v: List[Any], shape: Tuple[int, int, int, int], **kwargs: Any) -> bytes: ...
def error_kinds() -> List[Tuple[int, str]]: ...
def _raise(kind: int, message: str) -> None: ...
def _panic() -> None: ...
