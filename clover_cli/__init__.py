"""clover: fast local chat with large language models through Clover-2 speculative decoding."""

__version__ = "0.1.0"
