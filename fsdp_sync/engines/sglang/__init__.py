"""The SGLang adapter: drives an in-process ``sglang.Engine`` or an SGLang server as an `Engine`.

Holds the adapter (`adapter.SGLangEngine`), how it reaches SGLang (`client`: errors, in-process and
HTTP backends), the CUDA allocator switch around SGLang's memory (`allocator`), the per-rank
payloads for ``update_weights_from_tensor`` (`payloads`), the custom weight loader SGLang
imports by name (`loader`), what differs between SGLang releases (`versions`: 0.5.12, verl
0.9.1's pin, to 0.5.23) and what the adapter refuses before a sync sends anything (`refusals`).
Not here: the `Engine` protocol (`engines.base`), the built-in engine (`engines.reference`), the
wire form of a flattened bucket (`fsdp_sync.wire`). ``sglang`` itself is imported lazily, inside
functions, so importing this package does not pull it in.
"""

from .adapter import SGLangEngine
from .allocator import ExpandableSegments
from .client import SGLangError, SGLangHTTPError, SGLangUpdateError
from .payloads import BucketPayloads, bucket_payloads, flattened_bucket_payloads

__all__ = [
    "BucketPayloads", "flattened_bucket_payloads", "bucket_payloads", "SGLangEngine",
    "SGLangError", "SGLangHTTPError", "SGLangUpdateError", "ExpandableSegments",
]
