"""fp4lab.optim: Muon (bf16 or NVFP4 Newton-Schulz), AdamW (fp32 or NVFP4 second moment), QK-Clip.

Imports fp4lab.numerics only; the model layer (fp4lab.nn) and everything above stay out. The training
loop builds one `CombinedOptimizer` with `build_optimizer(model.named_parameters(), OptimizerConfig(...))`
and, when it clips logits, calls `qk_clip_` on each attention layer after `step()` (in a data-parallel run
after `all_reduce_max_logits_` of the layer's max logits). Sharded (FSDP2) parameters: `sharding.py`.
"""

from fp4lab.optim.adamw import AdamW, decode_v, encode_v
from fp4lab.optim.build import CombinedOptimizer, OptimizerConfig, build_optimizer, is_hidden_matrix
from fp4lab.optim.muon import Muon, newton_schulz
from fp4lab.optim.qk_clip import UpdateCap, all_reduce_max_logits_, qk_clip_

__all__ = [
    "AdamW",
    "CombinedOptimizer",
    "Muon",
    "OptimizerConfig",
    "UpdateCap",
    "all_reduce_max_logits_",
    "build_optimizer",
    "decode_v",
    "encode_v",
    "is_hidden_matrix",
    "newton_schulz",
    "qk_clip_",
]
