"""Expert parallelism: a layer's experts spread over ep ranks, tokens moved to them and back by all-to-all."""
from .all_to_all import (ExpertParallelError, Pending, all_to_all, bytes_sent, exchange_counts, reset_bytes_sent,
                         start_all_to_all)

__all__ = ["ExpertParallelError", "Pending", "all_to_all", "bytes_sent", "exchange_counts", "reset_bytes_sent",
           "start_all_to_all"]
