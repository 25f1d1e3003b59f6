"""flash-cute: exact FlashAttention in CuTe DSL for Ampere, Hopper and Blackwell."""

__version__ = "0.1.0"
