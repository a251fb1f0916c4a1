from typing import Any, Optional, Tuple

from ._native import Profile

LAYOUTS: Tuple[str, ...]

class KvcSerializer:
    layout: str
    level: int
    profile: Optional[Profile]
    def __init__(self, *, layout: str = "vllm", level: int = 7, profile: Optional[Profile] = None, **encode_kwargs: Any) -> None: ...
    def to_bytes(self, kv: Any) -> bytes: ...

class KvcDeserializer:
    layout: str
    profile: Optional[Profile]
    def __init__(self, *, layout: str = "vllm", profile: Optional[Profile] = None, dtype: Any = None, as_torch: Optional[bool] = None) -> None: ...
    def from_bytes(self, data: bytes, out: Any = None) -> Any: ...
