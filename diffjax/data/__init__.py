"""Data: tokenizers, raw sources, `diffjax prepare` shards, synthetic tasks and the Grain pipeline (docs/design.md §5).

The pipeline and the synthetic tasks import Grain; import them as `diffjax.data.pipeline` / `.synthetic`.
"""

from diffjax.data.sources import DataError, DataWarning
from diffjax.data.tokenizer import get_tokenizer

__all__ = ["DataError", "DataWarning", "get_tokenizer"]
